"""Where files live: local paths and object stores (``gs://``, ``s3://``) through one path type.

Every folder a run names (the train workdir, data folders, feature caches, target and drafter
folders) may be a local path or an object-store URI; all of them are ``etils.epath.Path``, the
path type Orbax uses, so every host of a TPU slice reads the same data and writes one set of
checkpoints. Object stores differ from a local disk in three ways this module hides:

- **Whole-object writes.** An upload becomes visible only once complete, so
  :func:`write_atomic` writes there directly; on a local disk it writes a temporary file,
  fsyncs it and renames it into place.
- **No appends.** :func:`append_text` rewrites the object with the new line (for small logs:
  metrics and the held-out curve).
- **No memory maps.** Memory-mapped feature caches, safetensors and GGUF files are read from a
  local copy (:func:`local_copy`, :func:`local_folder`), cached under ``$DSPARK_JAX_CACHE``
  (default ``~/.cache/dspark_jax``)``/remote`` and fetched again when the object's size or
  modification time changes.

Writing a folder (:func:`write_folder`) goes through a local temporary folder: renamed into
place on a local disk, uploaded file by file (``config.json`` last, so a reader that waits for
it never sees a partial folder) to an object store.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path as LocalPath
from typing import Callable, Union

from etils import epath

Path = epath.Path
PathLike = Union[str, os.PathLike]
REMOTE_SCHEMES = ("gs", "s3", "az")


def is_remote(path: PathLike) -> bool:
    """True for an object-store URI (gs://, s3://, az://)."""
    text = os.fspath(path)
    return "://" in text and text.split("://", 1)[0] in REMOTE_SCHEMES


def as_path(path: PathLike) -> epath.Path:
    """The path as ``epath.Path``; a local one made absolute (and ``~`` expanded), a remote
    one unchanged."""
    if is_remote(path):
        return epath.Path(os.fspath(path))
    return epath.Path(os.path.abspath(os.path.expanduser(os.fspath(path))))


def staging_file(path: PathLike) -> LocalPath:
    """A local file to write ``path``'s new contents into before :func:`publish`: beside it on
    a local disk, in the local cache of remote copies for a remote path."""
    path = as_path(path)
    local = LocalPath(os.fspath(path)) if not is_remote(path) else _cache_path(path)
    local.parent.mkdir(parents=True, exist_ok=True)
    return local.with_name(f".{local.name}.tmp")


def publish(staged: LocalPath, path: PathLike) -> None:
    """Puts a staged file (:func:`staging_file`, written and closed) in place of ``path``
    whole: fsynced and renamed on a local disk; uploaded to an object store, the staged file
    then kept as this host's cached copy (:func:`local_copy` does not fetch it back)."""
    path = as_path(path)
    fd = os.open(staged, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if not is_remote(path):
        os.replace(staged, os.fspath(path))
        return
    _upload(staged, path)
    cached = _cache_path(path)
    os.replace(staged, cached)
    cached.with_name(f".{cached.name}.stamp").write_text(_stamp(path))


def write_atomic(path: PathLike, data: bytes | str) -> None:
    """Writes a whole file so that a reader sees the old one or the new one, never a part."""
    staged = staging_file(path)
    with open(staged, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
    publish(staged, path)


def append_text(path: PathLike, text: str) -> None:
    """Appends ``text`` to a file (created when absent); on an object store the object is
    rewritten whole, so keep such files small (logs of a few thousand lines)."""
    path = as_path(path)
    if not is_remote(path):
        with open(os.fspath(path), "a", encoding="utf-8") as f:
            f.write(text)
        return
    old = path.read_text() if path.exists() else ""
    path.write_text(old + text)


def cache_root() -> LocalPath:
    """Where local copies of remote files go: ``$DSPARK_JAX_CACHE/remote`` (default
    ``~/.cache/dspark_jax/remote``)."""
    root = os.environ.get("DSPARK_JAX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dspark_jax")
    return LocalPath(root) / "remote"


def _cache_path(path: epath.Path) -> LocalPath:
    scheme, rest = os.fspath(path).split("://", 1)
    return cache_root() / scheme / rest


def _stamp(path: epath.Path) -> str:
    stat = path.stat()
    return f"{stat.length} {stat.mtime}"


def local_copy(path: PathLike) -> LocalPath:
    """A local file with the contents of ``path``: the path itself when local, else a cached
    copy (fetched when missing or when the object changed since)."""
    path = as_path(path)
    if not is_remote(path):
        return LocalPath(os.fspath(path))
    local = _cache_path(path)
    stamp_file = local.with_name(f".{local.name}.stamp")
    stamp = _stamp(path)
    if local.exists() and stamp_file.exists() and stamp_file.read_text() == stamp:
        return local
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = local.with_name(f".{local.name}.part")
    with path.open("rb") as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst, length=16 << 20)
    os.replace(tmp, local)
    stamp_file.write_text(stamp)
    return local


def local_folder(path: PathLike) -> LocalPath:
    """A local folder with the files of ``path`` (recursively): the folder itself when local,
    else a cached copy of every file (see :func:`local_copy`)."""
    path = as_path(path)
    if not is_remote(path):
        return LocalPath(os.fspath(path))
    if not path.is_dir():
        raise FileNotFoundError(f"no folder {path}")
    for child in path.iterdir():
        if child.is_dir():
            local_folder(child)
        else:
            local_copy(child)
    return _cache_path(path)


def _upload(local: PathLike, path: epath.Path) -> None:
    """Copies a local file to a remote ``path`` as one whole upload."""
    with open(local, "rb") as src, path.open("wb") as dst:
        shutil.copyfileobj(src, dst, length=16 << 20)


def write_folder(destination: PathLike, write: Callable[[LocalPath], None], *,
                 marker: str = "config.json") -> epath.Path:
    """Writes a folder through ``write(tmp)`` (a local temporary folder) and puts it in place
    of ``destination``, replacing what was there.

    Locally the folder is renamed into place, so a reader never sees a partial folder. On an
    object store the old objects are removed and the files uploaded, the top-level ``marker``
    file (the one readers look for: config.json, or an Orbax folder's metadata) last.
    """
    destination = as_path(destination)
    if not is_remote(destination):
        local = LocalPath(os.fspath(destination))
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = LocalPath(tempfile.mkdtemp(prefix=f".{local.name}.", dir=local.parent))
        try:
            write(tmp)
            if local.exists():
                old = local.with_name(f".{local.name}.old")
                shutil.rmtree(old, ignore_errors=True)
                local.rename(old)
                tmp.rename(local)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(local)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return destination
    with tempfile.TemporaryDirectory(prefix="dspark_jax_upload.") as tmp:
        write(LocalPath(tmp))
        if destination.exists():
            destination.rmtree()
        files = sorted((p for p in LocalPath(tmp).rglob("*") if p.is_file()),
                       key=lambda p: (str(p.relative_to(tmp)) == marker, str(p)))
        for file in files:
            target = destination / str(file.relative_to(tmp))
            target.parent.mkdir(parents=True, exist_ok=True)
            _upload(file, target)
    return destination
