"""The package's layout stays legible: no import circles among beam_dp's modules, and no module
over 800 lines unless its first docstring says why.

The import graph is built from the source (ast), not by importing, and counts every import of a
``beam_dp`` module, those inside functions too: a lazy import that closes a circle is a circle a
reader has to untangle all the same. Imports under ``if TYPE_CHECKING:`` are left out (they never
run).
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "beam_dp"
MAX_LINES = 800


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    return skipped


def import_graph() -> dict[str, set[str]]:
    """Module -> the beam_dp modules it imports (``from pkg import mod`` names the module)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        skipped = _type_checking_nodes(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    imported.add(submodule if submodule in modules else source)
        graph[name] = {m for m in imported if m in modules and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_the_cycle_check_sees_a_lazy_import():
    """The check itself: a circle closed by an import inside a function is found."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    tree = ast.parse("def f():\n    from beam_dp import data\n")
    assert any(isinstance(n, ast.ImportFrom) for n in ast.walk(tree))


def test_no_module_over_800_lines_without_a_reason():
    """A module over MAX_LINES lines says why in its first docstring (a sentence naming the
    800 lines), so that growth past the limit is a decision, not an accident."""
    too_long = []
    for name, path in _modules().items():
        source = path.read_text()
        if source.count("\n") > MAX_LINES:
            docstring = ast.get_docstring(ast.parse(source)) or ""
            if "800 lines" not in docstring:
                too_long.append(f"{name}: {source.count(chr(10))} lines")
    assert too_long == []


# ---------------------------------------------------------------- every path through the storage

# The calls that read, write, list or delete a path directly: outside beam_dp/storage.py and
# beam_dp/publish.py, a user's path (an output, a model, a checkpoint, a schema, an input) must
# go through those, or gs:// and s3:// paths would land on the local disk (issue 30).
DIRECT_FILE_CALLS = {"open", "os.replace", "os.rename", "os.remove", "os.makedirs", "os.listdir",
                     "shutil.rmtree", "os.path.exists", "os.path.isdir", "os.path.isfile",
                     "os.path.lexists", "tempfile.mkstemp", "tempfile.mkdtemp"}
# Files allowed such calls, and why (scratch space of our own, or a path that is local by nature).
LOCAL_BY_NATURE = {
    "storage.py": "the storage layer itself",
    "publish.py": "the publishing protocol; its local-only checks (links, empty directories)",
    "report.py": "atomic_directory's local scratch directory, published through beam_dp.publish",
    "predictions.py": "the local scratch file a predictions table is made in before its write",
    "outputs.py": "writes into atomic_directory's local scratch directory",
    "synthetic.py": "make-data writes its shards into atomic_directory's local scratch directory",
    "data.py": "input listing and opening: local globs and files here, remote ones through "
               "FileSystems (data.open_input, data.list_files)",
    "beam/aggregator.py": "the job work directory under --temp_location: FileSystems for remote "
                          "locations, a local one made 0700 (it holds raw rows); and "
                          "/proc/self/statm, the driver's own memory",
    "ledger/core.py": "the SQLite ledger file: a local database by nature",
    "ledger/sqlite.py": "the SQLite ledger file: a local database by nature",
    "frames.py": "a DataFrame's in-memory file (its open method)",
}


def _direct_file_calls(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in DIRECT_FILE_CALLS:
                found.append(f"{name} (line {node.lineno})")
    return found


def test_every_user_path_goes_through_the_storage_layer():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative not in LOCAL_BY_NATURE:
            calls = _direct_file_calls(path)
            if calls:
                offenders[relative] = calls
    assert offenders == {}, offenders
    assert all((PACKAGE / name).exists() for name in LOCAL_BY_NATURE)


def test_the_storage_check_sees_a_direct_open(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\ndef f(p):\n    with open(p) as f:\n        os.replace(p, p)\n")
    assert _direct_file_calls(module) == ["open (line 3)", "os.replace (line 4)"]
