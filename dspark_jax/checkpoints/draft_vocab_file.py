"""A drafter checkpoint's ``draft_vocab.json``: the tokens its draft step may propose.

Written by ``dspark-jax draft-vocab`` (the most frequent answer tokens of a drafter's training
data) into the drafter folder and read by ``load_drafter``: the draft step then computes its
LM head and sequential-head bias over those V' tokens only (``decoding.block_sampler``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np

from dspark_jax.checkpoints.folder_json import read_json_file, write_json_file

DRAFT_VOCAB_FILE = "draft_vocab.json"


def check_draft_vocab(token_ids, vocab_size: int | None = None) -> np.ndarray:
    """int32 ``[V']``: distinct token ids in ascending order, each < ``vocab_size`` when given."""
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"a draft vocabulary must be a non-empty 1-D list of token ids, got "
                         f"shape {ids.shape} of {ids.dtype}")
    ids = np.sort(ids.astype(np.int64))
    if ids[0] < 0 or (vocab_size is not None and ids[-1] >= vocab_size):
        raise ValueError(f"draft vocabulary ids must lie in [0, {vocab_size}), got "
                         f"{ids[0]}..{ids[-1]}")
    if np.any(ids[1:] == ids[:-1]):
        raise ValueError(f"draft vocabulary ids must be distinct; repeated: "
                         f"{np.unique(ids[1:][ids[1:] == ids[:-1]])[:10].tolist()}")
    return ids.astype(np.int32)


class DraftVocab(NamedTuple):
    """Contents of ``draft_vocab.json``."""

    token_ids: np.ndarray  # int32 [V'] ascending
    source: dict  # how it was chosen (data, counts, coverage)


def draft_vocab_text(token_ids, source: dict | None = None) -> str:
    """The contents of ``draft_vocab.json`` for ``token_ids`` [V'] and a source record."""
    payload = {"token_ids": check_draft_vocab(token_ids).tolist(),
               "source": {} if source is None else source}
    return json.dumps(payload, allow_nan=False) + "\n"


def save_draft_vocab(folder, token_ids, source: dict | None = None) -> Path:
    """Writes ``folder/draft_vocab.json`` atomically; returns its path.

    Raises:
      FileNotFoundError: ``folder`` is not a directory.
      ValueError: invalid token ids.
    """
    return write_json_file(folder, DRAFT_VOCAB_FILE, draft_vocab_text(token_ids, source))


def load_draft_vocab(path, vocab_size: int | None = None) -> DraftVocab:
    """Reads ``draft_vocab.json`` from a checkpoint folder or a direct file path.

    Raises:
      FileNotFoundError: no such file.
      ValueError: malformed file or invalid ids (out of ``[0, vocab_size)``, repeated).
    """
    path, payload = read_json_file(path, DRAFT_VOCAB_FILE, "token_ids", "draft vocabulary")
    try:
        ids = check_draft_vocab(payload["token_ids"], vocab_size)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err
    return DraftVocab(ids, dict(payload.get("source") or {}))
