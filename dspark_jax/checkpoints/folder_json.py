"""Small JSON files inside a drafter checkpoint folder (``calibration.json``,
``draft_vocab.json``): written atomically, read with errors that name the file."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_json_file(folder, name: str, text: str) -> Path:
    """Writes ``text`` to ``folder/name`` atomically; returns its path.

    Raises:
      FileNotFoundError: ``folder`` is not a directory.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no checkpoint folder {folder}")
    path = folder / name
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def read_json_file(path, name: str, key: str, kind: str) -> tuple[Path, dict]:
    """(file path, payload) of ``name`` in the folder ``path`` (or the file ``path`` itself),
    whose payload must hold ``key``.

    Raises:
      FileNotFoundError: no such file.
      ValueError: not JSON, or no ``key`` (named as a ``kind`` file).
    """
    path = Path(path)
    path = path / name if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"no {name} at {path}")
    try:
        payload = json.loads(path.read_text())
        payload[key]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a {kind} file: {err!r}") from err
    return path, payload
