"""Every path a command reads or writes, through Beam's file systems (``FileSystems``): local
paths, ``gs://``, ``s3://`` and any scheme a Beam file system registers. Nothing else in beam_dp
opens, lists, renames or deletes a user's path (``tests/test_layout.py`` checks that).

Beam is imported inside the functions: ``import beam_dp.storage`` stays cheap for the numpy core.

An object on GCS or S3 appears only once it is whole (an upload is committed at its end), so
``write_bytes`` writes an object in place; on a local disk it writes a temporary file in the
same directory (or in ``tmp_dir``) and renames it over the target, which is atomic there.
"""
from __future__ import annotations

import os
import posixpath
import uuid
from typing import BinaryIO, Iterable


def is_remote(path: str) -> bool:
    return "://" in path


def normalize(path: str) -> str:
    """An absolute local path, or the URL without a trailing slash."""
    return path.rstrip("/") if is_remote(path) else os.path.abspath(path)


def join(base: str, *names: str) -> str:
    return posixpath.join(base, *names) if is_remote(base) else os.path.join(base, *names)


def parent(path: str) -> str:
    if not is_remote(path):
        return os.path.dirname(path)
    scheme, rest = path.split("://", 1)
    return f"{scheme}://{posixpath.dirname(rest.rstrip('/'))}" if "/" in rest.rstrip("/") else path


def basename(path: str) -> str:
    return posixpath.basename(path.rstrip("/")) if is_remote(path) else os.path.basename(path)


def _filesystems():
    from apache_beam.io.filesystems import FileSystems   # (Beam's import takes ~2 s)
    return FileSystems


def _uncompressed():
    from apache_beam.io.filesystem import CompressionTypes
    return CompressionTypes.UNCOMPRESSED


def exists(path: str) -> bool:
    """Whether a file (an object) is at ``path``; a local directory counts too."""
    if not is_remote(path):
        return os.path.lexists(path)
    return _filesystems().exists(path)


def is_local_dir(path: str) -> bool:
    return not is_remote(path) and os.path.isdir(path)


def open_read(path: str) -> BinaryIO:
    """A binary reader of ``path``; FileNotFoundError (naming the path) if nothing is there."""
    if not is_remote(path):
        return open(path, "rb")
    fs = _filesystems()
    if not fs.exists(path):
        raise FileNotFoundError(f"{path}: not found")
    return fs.open(path, compression_type=_uncompressed())


def read_bytes(path: str) -> bytes:
    with open_read(path) as f:
        return f.read()


def read_text(path: str) -> str:
    return read_bytes(path).decode("utf-8")


def write_bytes(path: str, content: bytes, tmp_dir: str | None = None,
                private: bool = False) -> None:
    """Writes ``content`` as the file ``path``, replacing any, so that a reader finds the old
    bytes or the new ones, never a part (see the module's docstring). ``private``: on a local
    disk, readable by this user only (an object store's access is its bucket's)."""
    if is_remote(path):
        with _filesystems().create(path, compression_type=_uncompressed()) as f:
            f.write(content)
        return
    directory = tmp_dir or os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        # exclusive: nobody can have planted a link there
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                               0o600 if private else 0o666), "wb") as f:
            f.write(content)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise


def list_files(directory: str) -> dict[str, int]:
    """Every file under ``directory`` (recursively), by its path relative to it, with its size.
    On a local disk a symbolic link or other special entry is listed with size -1, so that a
    caller checking what a directory holds never takes one for a file."""
    directory = normalize(directory)
    if not is_remote(directory):
        found = {}
        if not os.path.isdir(directory):
            return found
        for root, dirs, files in os.walk(directory):
            for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
                path = os.path.join(root, name)
                status = os.lstat(path)
                regular = not os.path.islink(path) and os.path.isfile(path)
                found[os.path.relpath(path, directory)] = status.st_size if regular else -1
        return found
    prefix = directory + "/"
    (result,) = _filesystems().match([prefix + "**"])
    return {m.path[len(prefix):]: m.size_in_bytes for m in result.metadata_list
            if m.path.startswith(prefix) and not m.path.endswith("/")}


def delete_tree(directory: str) -> None:
    """Deletes every file under ``directory`` (and, locally, the directory); none is fine."""
    directory = normalize(directory)
    if not is_remote(directory):
        import shutil
        shutil.rmtree(directory, ignore_errors=True)
        return
    names = list_files(directory)
    if names:
        _filesystems().delete([join(directory, n) for n in names])


def delete_files(paths: Iterable[str]) -> None:
    paths = [p for p in paths if exists(p)]
    if not paths:
        return
    if not is_remote(paths[0]):
        for p in paths:
            os.remove(p)
        return
    _filesystems().delete(paths)


def check_writable_parent(path: str) -> None:
    """Refuses a local path whose nearest existing parent is not a writable directory (object
    stores have no directories: their permissions show at the first write)."""
    if is_remote(path):
        return
    up = os.path.dirname(path)
    while not os.path.exists(up):
        up = os.path.dirname(up)
    if not os.path.isdir(up) or not os.access(up, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write {path}: {up} is not a writable directory")


# Flags of Beam's file systems (S3Options: --s3_endpoint_url, --s3_region_name, ...): every
# command takes them, the local runner too, since every command reads or writes through here.
FILE_SYSTEM_FLAG_PREFIXES = ("--s3_",)


def split_file_system_flags(extra: list[str]) -> tuple[list[str], list[str]]:
    """(file-system flags, the other tokens) of a command's flags Beam would take."""
    ours, rest, i = [], [], 0
    while i < len(extra):
        token = extra[i]
        if token.startswith(FILE_SYSTEM_FLAG_PREFIXES):
            ours.append(token)
            if "=" not in token and i + 1 < len(extra) and not extra[i + 1].startswith("--"):
                ours.append(extra[i + 1])
                i += 1
        else:
            rest.append(token)
        i += 1
    return ours, rest


def configure(flags: list[str]) -> None:
    """Gives Beam's file systems their options (an S3 endpoint, region, keys) in this process;
    a Beam job's workers get them with the job's pipeline options."""
    if not flags:
        return
    from apache_beam.options.pipeline_options import PipelineOptions
    _filesystems().set_options(PipelineOptions(flags))
