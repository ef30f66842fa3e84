"""Output directories published atomically on every file system, object stores included.

An object store has no directory rename, so a directory cannot be swapped in whole. Instead every
output directory holds a manifest, ``.beam-dp-output.json``, written last, and readers trust only
what a manifest names. Publishing ``files`` as ``OUT``:

1. every file is written under a fresh staging prefix ``OUT/.staging-<id>/``;
2. the manifest is written naming that prefix as where the files are (one object write: atomic);
3. the files are written again at the top of ``OUT`` (one atomic write each), and files of the
   old version that the new one lacks are deleted;
4. the manifest is written again naming the top of ``OUT``;
5. the staging prefix, and any a dead run left, is deleted.

At every moment the manifest names a complete set of files, the old one until step 2, the new
one from then on, so a reader (``read``: predict, a warm start, ``Model.load``, a rerun of a
committed release) finds the old model or the new one, never none. A reader that read the
manifest just before a step 3 or 5 may find a file changed or gone: each file's SHA-256 is in
the manifest, so it sees that and reads the manifest again. A kill at any step leaves a complete
manifest, or no manifest and only staging prefixes (a first publish), which the next publish
on the same output removes. One writer per output at a time (the budget ledger serializes the
runs of a release; ``--overwrite`` of another's output is refused anyway).

The manifest also says what beam-dp wrote there, which is what ``--overwrite`` checks: it
replaces only a directory beam-dp published, holding nothing else.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
import uuid

from beam_dp import storage

MANIFEST = ".beam-dp-output.json"
STAGING = ".staging-"
READ_ATTEMPTS = 20


def refusal(path: str, why: str) -> FileExistsError:
    return FileExistsError(f"{path} {why}; nothing was replaced or deleted")


def read_manifest(path: str) -> dict | None:
    """The manifest of the output directory ``path``, or None if it has none (not an output, or
    a first publish not finished). Older outputs' manifests list sizes only."""
    try:
        content = json.loads(storage.read_bytes(storage.join(path, MANIFEST)))
        files = content["files"]
        if content.get("written_by") != "beam-dp" or not isinstance(files, dict):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    content.setdefault("location", "")
    content.setdefault("sha256", {})
    return content


def is_published(path: str) -> bool:
    return read_manifest(storage.normalize(path)) is not None


def _ours(name: str) -> bool:
    return name == MANIFEST or name.startswith(STAGING)


def check_output_directory(path: str, overwrite: bool) -> None:
    """Refuses, before any work, an output that exists, unless ``overwrite`` is set and it is a
    directory beam-dp published holding only what beam-dp wrote there (its manifest lists that).
    A file, a link or a directory with anything else is never replaced. A directory holding
    only a dead first publish's staging prefixes counts as absent."""
    path = storage.normalize(path)
    check_not_in_an_output(path)
    local = not storage.is_remote(path)
    if local and (os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path))):
        if not overwrite:
            raise FileExistsError(f"{path} already exists (pass --overwrite, or overwrite=True "
                                  "in Python, to replace a directory beam-dp wrote)")
        raise refusal(path, "is not a directory beam-dp wrote (--overwrite replaces only those)")
    entries = storage.list_files(path)
    names = set(os.listdir(path)) if local and os.path.isdir(path) else {_top(n) for n in entries}
    present = os.path.lexists(path) if local else bool(entries)
    if not present or (names and all(name.startswith(STAGING) for name in names)):
        storage.check_writable_parent(path)
        return   # nothing there, or a dead first publish's staging only
    if not overwrite:
        raise FileExistsError(f"{path} already exists (pass --overwrite, or overwrite=True in "
                              "Python, to replace a directory beam-dp wrote)")
    manifest = read_manifest(path)
    if manifest is None:
        raise refusal(path, f"has no {MANIFEST} manifest, so beam-dp did not write it "
                            "(--overwrite replaces only directories beam-dp wrote)")
    listed = manifest["files"]
    interrupted = manifest["location"] != ""   # its top-level files may be old or new ones
    # Only regular files the manifest lists, with the sizes it recorded: a directory, a link, a
    # file added or changed since (or a manifest edited to list a user's file) is not ours.
    foreign = [name for name, size in entries.items() if not _ours(_top(name)) and not (
        name in listed and size >= 0 and (interrupted or size == listed[name]))]
    # (locally, an entry holding no file, e.g. an empty directory, is listed by name only)
    foreign += [name for name in names if not _ours(name) and name not in listed
                and not any(_top(entry) == name for entry in entries)]
    if foreign:
        raise refusal(path, f"holds {len(foreign)} entries beam-dp did not write there or that "
                            "changed since (move them away first)")


def _top(name: str) -> str:
    return name.replace("\\", "/").split("/", 1)[0]


def check_not_in_an_output(path: str) -> None:
    """Refuses an output inside a directory beam-dp wrote: it would become an entry that
    directory's manifest does not list, so that output could no longer be replaced (--overwrite)
    and a reader of it would find a foreign directory among the released files."""
    up = storage.parent(path)
    while up and up != path:
        if storage.exists(storage.join(up, MANIFEST)):
            raise refusal(path, f"is inside {up}, an output directory beam-dp wrote: write it "
                                "elsewhere")
        path, up = up, storage.parent(up)


def publish(path: str, files: dict[str, bytes], overwrite: bool = False) -> None:
    """Publishes ``files`` (name -> content) as the output directory ``path`` (see the module's
    docstring). Refused before anything is written when ``check_output_directory`` refuses."""
    path = storage.normalize(path)
    check_output_directory(path, overwrite)
    old = read_manifest(path)
    stage_name = STAGING + uuid.uuid4().hex[:16]
    stage = storage.join(path, stage_name)
    manifest = {"written_by": "beam-dp", "location": stage_name,
                "files": {name: len(content) for name, content in files.items()},
                "sha256": {name: hashlib.sha256(content).hexdigest()
                           for name, content in files.items()}}
    try:
        for name, content in files.items():
            storage.write_bytes(storage.join(stage, name), content)
        if read_manifest(path) != old:   # another run published it meanwhile
            raise refusal(path, "was published by another run while this one wrote")
        storage.write_bytes(storage.join(path, MANIFEST), _json(manifest), tmp_dir=stage)
    except BaseException:
        storage.delete_tree(stage)
        raise
    for name, content in files.items():
        storage.write_bytes(storage.join(path, name), content, tmp_dir=stage)
    if old is not None:
        storage.delete_files([storage.join(path, name) for name in old["files"]
                              if name not in files])
    storage.write_bytes(storage.join(path, MANIFEST), _json({**manifest, "location": ""}),
                        tmp_dir=stage)
    _remove_staging(path)


def _remove_staging(path: str) -> None:
    """Deletes every staging prefix under ``path``: this publish's and dead runs' ones; and, on
    a local disk, what a run of an earlier beam-dp killed while replacing ``path`` left beside
    it (see ``_earlier_leftovers``)."""
    for leftover in _earlier_leftovers(path):
        storage.delete_tree(leftover)
    for prefix in sorted({_top(name) for name in storage.list_files(path)
                          if _top(name).startswith(STAGING)}):
        storage.delete_tree(storage.join(path, prefix))
    if not storage.is_remote(path):   # empty local staging directories list no file
        for name in os.listdir(path):
            if name.startswith(STAGING):
                storage.delete_tree(os.path.join(path, name))


def _earlier_leftovers(path: str) -> list[str]:
    """Directories that beam-dp before this layout (a temporary directory renamed over the
    output) left beside a local output when killed mid-replacement: ``.NAME.old-*`` holding the
    replaced output (``previous/`` with its manifest) and ``.NAME.tmp-*`` holding a finished
    one (its manifest) or nothing. Anything else of those names is not known to be ours: kept."""
    if storage.is_remote(path):
        return []
    up, name = os.path.split(path)
    found = []
    for entry in sorted(os.listdir(up)) if os.path.isdir(up) else []:
        full = os.path.join(up, entry)
        if os.path.islink(full) or not os.path.isdir(full):
            continue
        if entry.startswith(f".{name}.old-"):
            if os.path.isfile(os.path.join(full, "previous", MANIFEST)):
                found.append(full)
        elif entry.startswith(f".{name}.tmp-"):
            if not os.listdir(full) or os.path.isfile(os.path.join(full, MANIFEST)):
                found.append(full)
    return found


def _json(value: dict) -> bytes:
    return (json.dumps(value, indent=1, sort_keys=True) + "\n").encode()


def read(path: str, names=None) -> dict[str, bytes]:
    """The files ``names`` (default: all) of the output directory ``path`` as one manifest
    names them: all of one published version. ValueError (one line) when ``path`` is not a
    published output or lacks one of ``names``."""
    path = storage.normalize(path)
    previous, unchanged = None, 0
    for attempt in range(READ_ATTEMPTS):
        manifest = read_manifest(path)
        if manifest is None:
            raise ValueError(f"{path}: not a complete beam-dp output directory (no {MANIFEST})")
        wanted = list(manifest["files"]) if names is None else list(names)
        missing = [name for name in wanted if name not in manifest["files"]]
        if missing:
            raise ValueError(f"{path}: no {' or '.join(missing)}")
        where = storage.join(path, manifest["location"]) if manifest["location"] else path
        found = {}
        try:
            for name in wanted:
                content = storage.read_bytes(storage.join(where, name))
                if not _matches(content, manifest, name):
                    raise FileNotFoundError(name)   # replaced since the manifest was read
                found[name] = content
        except FileNotFoundError:
            # A publish in progress changes the manifest; one that stays the same while its
            # file does not match it was damaged by hand.
            unchanged = unchanged + 1 if manifest == previous else 0
            if unchanged >= 3:
                raise ValueError(f"{path}: {name} is missing or differs from what its manifest "
                                 f"({MANIFEST}) lists: changed by hand since beam-dp wrote it"
                                 ) from None
            previous = manifest
            time.sleep(0.02 * (attempt + 1))
            continue
        return found
    raise ValueError(f"{path}: changed while being read ({READ_ATTEMPTS} tries): another run is "
                     "publishing it; try again")


def _matches(content: bytes, manifest: dict, name: str) -> bool:
    digest = manifest["sha256"].get(name)
    if digest is not None:
        return hashlib.sha256(content).hexdigest() == digest
    return len(content) == manifest["files"][name]


def latest_before(root: str, before: str, pattern: str = r"\d{4}-\d{2}-\d{2}") -> str | None:
    """The published output directory ``root/<name>`` with the greatest name that matches
    ``pattern`` (a date, by default) and sorts before ``before``, holding a model.json: a daily
    job's newest released model before its date (a released model: starting from it costs no
    budget). None if there is none. On any file system."""
    import re

    root = storage.normalize(root)
    if storage.is_remote(root):
        names = {_top(name) for name in storage.list_files(root)}
    else:
        names = set(os.listdir(root)) if os.path.isdir(root) else set()
    for name in sorted((n for n in names if re.fullmatch(pattern, n) and n < before),
                       reverse=True):
        manifest = read_manifest(storage.join(root, name))
        if manifest is not None and "model.json" in manifest["files"]:
            return storage.join(root, name)
    return None
