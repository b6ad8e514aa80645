"""Where files live: local paths and object stores (``gs://``, ``s3://``) through one path type.

Every folder a run names (the train workdir, data folders, feature caches, target and drafter
folders) may be a local path or an object-store URI; all of them are ``etils.epath.Path``, the
path type Orbax uses, so every host of a TPU slice reads the same data and writes one set of
checkpoints (``pip install -e ".[gcs]"`` adds gcsfs, which reads gs://). Object stores differ
from a local disk in three ways this module hides:

- **Whole-object writes.** An upload becomes visible only once complete, so :func:`publish`
  uploads a staged local file; on a local disk it fsyncs the file and renames it into place.
- **No appends, and about one update per second per object.** :class:`LineLog` appends lines
  to a local file at once and rewrites a remote object at most every ``flush_s`` seconds.
- **No memory maps.** Memory-mapped feature caches, safetensors and GGUF files are read from a
  local copy (:func:`local_copy`, :func:`local_folder`) under :func:`cache_dir`\\ ``/remote``,
  fetched again when the object changes (its generation, etag or checksum, from fsspec).

Writing a folder (:func:`write_folder`) goes through a local temporary folder: renamed into
place on a local disk; on an object store its marker file (config.json, or an Orbax folder's
metadata, which readers look for) is removed first and uploaded last.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path as LocalPath
from typing import Callable, Union

from etils import epath

Path = epath.Path
PathLike = Union[str, os.PathLike]
AnyPath = Union[LocalPath, epath.Path]  # what writers return: see returned()
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


def returned(path: epath.Path) -> AnyPath:
    """What a writer returns for ``path``: a ``pathlib.Path`` when it is local (the path type
    callers expect, with ``stat().st_size``), the ``epath.Path`` itself when it is remote."""
    return path if is_remote(path) else LocalPath(os.fspath(path))


def cache_dir() -> LocalPath:
    """Root of dspark-jax's local cache: $DSPARK_JAX_CACHE, else $XDG_CACHE_HOME/dspark_jax
    (converted models, SPS tables, local copies of remote files)."""
    root = os.environ.get("DSPARK_JAX_CACHE")
    if root:
        return LocalPath(root)
    return LocalPath(os.environ.get("XDG_CACHE_HOME", LocalPath.home() / ".cache")) / "dspark_jax"


def _cache_path(path: epath.Path) -> LocalPath:
    """Where the local copy of a remote ``path`` goes: cache_dir()/remote/<scheme>/<key>."""
    scheme, rest = os.fspath(path).split("://", 1)
    return cache_dir() / "remote" / scheme / rest


def _version(path: epath.Path) -> str:
    """What changes whenever a remote object is rewritten: its size and generation (GCS),
    etag (S3) or checksum, else its modification time, from fsspec."""
    import fsspec

    fs, key = fsspec.core.url_to_fs(os.fspath(path))
    info = fs.info(key)
    tag = next((info[k] for k in ("generation", "etag", "ETag", "crc32c", "md5Hash", "mtime",
                                  "updated") if info.get(k) is not None), "")
    return f"{info.get('size')} {tag}"


def _replace_with(text: str, path: LocalPath) -> None:
    """Writes a small local file whole (temporary file, then rename)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _stamp_file(local: LocalPath) -> LocalPath:
    return local.with_name(f".{local.name}.stamp")


def staging_file(path: PathLike) -> LocalPath:
    """A local file to write ``path``'s new contents into before :func:`publish`, its folder
    created: ``.<name>.tmp`` beside a local path (a rerun after a kill overwrites it), a file
    of its own in the local cache for a remote path (the cache may be shared)."""
    path = as_path(path)
    if not is_remote(path):
        local = LocalPath(os.fspath(path))
        local.parent.mkdir(parents=True, exist_ok=True)
        return local.with_name(f".{local.name}.tmp")
    local = _cache_path(path)
    local.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=local.parent, prefix=f".{local.name}.", suffix=".tmp")
    os.close(fd)
    return LocalPath(tmp)


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
    _replace_with(_version(path), _stamp_file(cached))


def write_atomic(path: PathLike, data: bytes | str) -> None:
    """Writes a whole file so that a reader sees the old one or the new one, never a part."""
    staged = staging_file(path)
    with open(staged, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
    publish(staged, path)


class LineLog:
    """An append-only text log (metrics.jsonl, heldout.jsonl) on a local disk or an object store.

    Locally each line is appended at once. An object cannot be appended to (and takes about one
    update per second), so a remote log keeps its lines and rewrites the object whole at most
    every ``flush_s`` seconds, and on :meth:`flush` (call it at checkpoints and at the end).
    """

    def __init__(self, path: PathLike, flush_s: float = 30.0):
        self.path = as_path(path)
        self.remote = is_remote(self.path)
        self.flush_s = flush_s
        self._text = None  # the remote object's contents, read on the first write
        self._pending = False
        self._flushed = time.monotonic()

    def write(self, line: str) -> None:
        if not self.remote:
            with open(os.fspath(self.path), "a", encoding="utf-8") as f:
                f.write(line)
            return
        if self._text is None:
            self._text = self.path.read_text() if self.path.exists() else ""
        self._text += line
        self._pending = True
        if time.monotonic() - self._flushed >= self.flush_s:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            self.path.write_text(self._text)
            self._pending = False
        self._flushed = time.monotonic()


def local_copy(path: PathLike) -> LocalPath:
    """A local file with the contents of ``path``: the path itself when local, else a cached
    copy, fetched when missing or when the object changed since (:func:`_version`)."""
    path = as_path(path)
    if not is_remote(path):
        return LocalPath(os.fspath(path))
    local = _cache_path(path)
    stamp_file = _stamp_file(local)
    version = _version(path)
    if local.exists() and stamp_file.exists() and stamp_file.read_text() == version:
        return local
    local.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=local.parent, prefix=f".{local.name}.", suffix=".part")
    with path.open("rb") as src, os.fdopen(fd, "wb") as dst:
        shutil.copyfileobj(src, dst, length=16 << 20)
    os.replace(tmp, local)
    _replace_with(version, stamp_file)
    return local


def local_folder(path: PathLike) -> LocalPath:
    """A local folder with the files of ``path`` (recursively): the folder itself when local,
    else a cached mirror of it (each file as :func:`local_copy`; local files the remote folder
    no longer has are removed)."""
    path = as_path(path)
    if not is_remote(path):
        return LocalPath(os.fspath(path))
    if not path.is_dir():
        raise FileNotFoundError(f"no folder {path}")
    names = set()
    for child in path.iterdir():
        names.add(child.name)
        if child.is_dir():
            local_folder(child)
        else:
            local_copy(child)
    local = _cache_path(path)
    local.mkdir(parents=True, exist_ok=True)
    for entry in local.iterdir():  # hidden files but stamps: other processes' downloads
        stamp = entry.name.startswith(".") and entry.name.endswith(".stamp")
        if entry.name.startswith(".") and not stamp:
            continue
        if (entry.name[1:-len(".stamp")] if stamp else entry.name) not in names:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    return local


def _upload(local: PathLike, path: epath.Path) -> None:
    """Copies a local file to a remote ``path`` as one whole upload."""
    with open(local, "rb") as src, path.open("wb") as dst:
        shutil.copyfileobj(src, dst, length=16 << 20)


def write_folder(destination: PathLike, write: Callable[[LocalPath], None], *,
                 marker: str = "config.json") -> AnyPath:
    """Writes a folder through ``write(tmp)`` (a local temporary folder) and puts it in place
    of ``destination``, replacing what was there.

    Locally the folder is renamed into place, so a reader never sees a partial folder. On an
    object store the old ``marker`` (the top-level file readers look for: config.json, or an
    Orbax folder's metadata) is removed first, the files are uploaded over the old ones, the
    old files the new folder lacks are removed, and the marker is uploaded last: an
    interrupted upload leaves a folder without its marker, never a mix that looks complete.
    Returns the folder (:func:`returned`).
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
        return returned(destination)
    with tempfile.TemporaryDirectory(prefix="dspark_jax_upload.") as tmp:
        write(LocalPath(tmp))
        files = sorted(str(p.relative_to(tmp)) for p in LocalPath(tmp).rglob("*") if p.is_file())
        if (destination / marker).exists():
            (destination / marker).unlink()
        for name in files:
            if name != marker:
                (destination / name).parent.mkdir(parents=True, exist_ok=True)
                _upload(LocalPath(tmp) / name, destination / name)
        if destination.exists():
            _remove_others(destination, set(files))
        if marker in files:
            _upload(LocalPath(tmp) / marker, destination / marker)
    return destination


def _remove_others(folder: epath.Path, keep: set[str], prefix: str = "") -> None:
    """Removes the files under a remote ``folder`` whose relative paths are not in ``keep``."""
    for child in folder.iterdir():
        name = prefix + child.name
        if child.is_dir():
            _remove_others(child, keep, name + "/")
        elif name not in keep:
            child.unlink()
