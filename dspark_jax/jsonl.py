"""JSONL prompt files: one JSON object per line, errors that name the file and line."""

from __future__ import annotations

import json
import os
from typing import Iterator


def read_jsonl(path: str | os.PathLike) -> Iterator[tuple[str, dict]]:
    """Yields ``("<path>:<line>", record)`` for each non-blank line of ``path``.

    Lines end at newlines only (file iteration), so separators such as U+2028 that JSON strings
    may hold (arena-hard-v2 has them) stay inside their line, unlike ``str.splitlines``.

    Raises:
      ValueError: a line that is not a JSON object, named by file and line number.
    """
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not a JSON object ({e})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: not a JSON object (got {type(record).__name__})")
            yield where, record
