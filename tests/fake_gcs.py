"""A stand-in for Google Cloud Storage: ``gs://bucket/key`` objects kept under a local folder,
reached through the same fsspec backend of ``etils.epath`` that gcsfs plugs into.

Like GCS, it writes whole objects only (appending raises) and needs no folders before a
write; every write is recorded (in order) so tests can check what a reader could see. No
network, no credentials."""

from __future__ import annotations

import os

import fsspec
from etils.epath import backend
from fsspec.implementations.local import LocalFileSystem


class FakeGCS(LocalFileSystem):
    protocol = ("gs", "gcs")
    root_marker = ""
    cachable = False
    root = "/nonexistent"  # set by install()
    writes: list[str] = []  # gs:// keys in the order their writes were opened

    def __init__(self, *args, **kwargs):  # gcsfs options such as finalize_on_close
        super().__init__()

    @classmethod
    def _strip_protocol(cls, path):
        path = os.fspath(path)
        for prefix in ("gs://", "gcs://"):
            if path.startswith(prefix):
                return os.path.join(cls.root, path[len(prefix):]).rstrip("/")
        return super()._strip_protocol(path)

    def _open(self, path, mode="rb", **kwargs):
        if "a" in mode:
            raise OSError(f"GCS objects cannot be appended to ({path})")
        if "w" in mode:  # objects need no folders: their prefixes are made on the fly
            local = self._strip_protocol(path)
            os.makedirs(os.path.dirname(local), exist_ok=True)
            FakeGCS.writes.append(os.path.relpath(local, FakeGCS.root))
        return super()._open(path, mode=mode, **kwargs)


def install(root) -> None:
    """Serves gs:// from ``root`` (for this process) and forgets earlier writes."""
    FakeGCS.root = str(root)
    FakeGCS.writes = []
    os.makedirs(root, exist_ok=True)
    for protocol in FakeGCS.protocol:
        fsspec.register_implementation(protocol, FakeGCS, clobber=True)
    backend.fsspec_backend._get_filesystem.cache_clear()
