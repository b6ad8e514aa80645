"""The acceptance trace: what the engine records for the confidence metrics (spec section 8).

With full-block verification (truncation off) the engine records one entry per
(request, round):

* ``confidence_logits`` float32 ``[n, P]``: the confidence head's logits ``z_k`` for the
  ``P`` proposals of the block (per-step confidence ``c_k = sigmoid(z_k / T_k)``,
  ``T_k = 1`` before calibration).
* ``num_accepted`` int32 ``[n]``: draft tokens the verifier accepted, ``0..P``.  The
  realised survival of position ``k`` (0-based) is ``num_accepted > k``.
* ``request_ids`` int64 ``[n]`` (optional): which request each round belongs to, so that a
  held-out split keeps all rounds of a request on one side.  ``None`` means every round is
  its own request.

Rows recorded with truncation on must not be mixed in: the labels of the positions that were
never verified are unknown (the spec's censoring/selection-bias warning).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

__all__ = ["AcceptanceTrace", "concatenate_traces", "split_by_request"]


class AcceptanceTrace(NamedTuple):
    """Per-round confidence logits and accepted counts (see the module docstring).

    Build with :meth:`create`, which converts dtypes and validates; every consumer in
    ``dspark_jax.evaluation`` re-validates with :meth:`validate`.
    """

    confidence_logits: np.ndarray  # float32 [n, P]
    num_accepted: np.ndarray  # int32 [n]
    request_ids: np.ndarray | None = None  # int64 [n]

    @classmethod
    def create(cls, confidence_logits, num_accepted, request_ids=None) -> AcceptanceTrace:
        """Converts array-likes (numpy, jax, lists) and validates.

        Args:
          confidence_logits: float ``[n, P]``.
          num_accepted: integer ``[n]`` in ``0..P``.
          request_ids: optional integer ``[n]``.

        Raises:
          ValueError: wrong rank or length, empty trace, NaN logits, non-integer or
            out-of-range ``num_accepted``.
        """
        logits = np.asarray(confidence_logits, dtype=np.float32)
        accepted = np.asarray(num_accepted)
        if (accepted.size and not np.issubdtype(accepted.dtype, np.integer)
                and not np.all(np.asarray(accepted, np.float64) == np.round(accepted))):
            raise ValueError("num_accepted must hold integers")
        ids = None if request_ids is None else np.asarray(request_ids)
        if ids is not None and ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"request_ids must be integers, got dtype {ids.dtype}")
        trace = cls(logits, accepted.astype(np.int32),
                    None if ids is None else ids.astype(np.int64))
        return trace.validate()

    def validate(self) -> AcceptanceTrace:
        """Checks shapes, dtypes and ranges; returns ``self``.

        Raises:
          ValueError: see :meth:`create`.
        """
        logits, accepted, ids = self.confidence_logits, self.num_accepted, self.request_ids
        if not isinstance(logits, np.ndarray) or logits.ndim != 2:
            raise ValueError("confidence_logits must be a 2-D array [n, P], got shape "
                             f"{np.shape(logits)}")
        n, block = logits.shape
        if n == 0:
            raise ValueError("empty acceptance trace: no rounds were recorded")
        if block == 0:
            raise ValueError("confidence_logits has no proposal positions (P = 0)")
        if np.isnan(logits).any():
            raise ValueError("confidence_logits contains NaN")
        if (not isinstance(accepted, np.ndarray) or accepted.shape != (n,)
                or not np.issubdtype(accepted.dtype, np.integer)):
            raise ValueError(f"num_accepted must be an integer array [{n}], got shape "
                             f"{np.shape(accepted)}")
        if accepted.min() < 0 or accepted.max() > block:
            raise ValueError(f"num_accepted must lie in 0..{block}, got values in "
                             f"{accepted.min()}..{accepted.max()}")
        if ids is not None and (not isinstance(ids, np.ndarray) or ids.shape != (n,)
                                or not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"request_ids must be an integer array [{n}], got shape "
                             f"{np.shape(ids)}")
        return self

    @property
    def num_rounds(self) -> int:
        """``n``, the number of recorded rounds."""
        return int(self.confidence_logits.shape[0])

    @property
    def block_size(self) -> int:
        """``P``, the number of proposals per round."""
        return int(self.confidence_logits.shape[1])

    def group_ids(self) -> np.ndarray:
        """int64 ``[n]``: ``request_ids``, or one id per round when there are none."""
        if self.request_ids is None:
            return np.arange(self.num_rounds, dtype=np.int64)
        return self.request_ids

    def select(self, rows: np.ndarray) -> AcceptanceTrace:
        """The sub-trace of ``rows`` (bool mask ``[n]`` or integer indices)."""
        ids = None if self.request_ids is None else self.request_ids[rows]
        return AcceptanceTrace.create(self.confidence_logits[rows], self.num_accepted[rows], ids)

    def save(self, path) -> Path:
        """Writes the trace to ``path`` as an uncompressed ``.npz``; returns the path."""
        path = Path(path)
        if path.suffix != ".npz":
            raise ValueError(f"acceptance traces are saved as .npz, got {path}")
        self.validate()
        arrays = {"confidence_logits": self.confidence_logits, "num_accepted": self.num_accepted}
        if self.request_ids is not None:
            arrays["request_ids"] = self.request_ids
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            np.savez(f, **arrays)
        return path

    @classmethod
    def load(cls, path) -> AcceptanceTrace:
        """Reads a trace written by :meth:`save`.

        Raises:
          FileNotFoundError: no such file.
          ValueError: missing arrays or invalid contents.
        """
        with np.load(Path(path), allow_pickle=False) as data:
            missing = {"confidence_logits", "num_accepted"} - set(data.files)
            if missing:
                raise ValueError(f"{path} is not an acceptance trace: missing {sorted(missing)}")
            ids = data["request_ids"] if "request_ids" in data.files else None
            return cls.create(data["confidence_logits"], data["num_accepted"], ids)


def concatenate_traces(traces: Sequence[AcceptanceTrace]) -> AcceptanceTrace:
    """Joins traces with the same ``P`` (e.g. the benchmarks of one domain).

    Requests of different traces stay distinct: each trace's request ids (or its rounds, when
    it has none) are renumbered after those of the previous traces.

    Returns:
      a trace with ``request_ids`` set.

    Raises:
      ValueError: no traces, or different block sizes.
    """
    if not traces:
        raise ValueError("concatenate_traces needs at least one trace")
    blocks = {t.validate().block_size for t in traces}
    if len(blocks) != 1:
        raise ValueError(f"cannot concatenate traces with different block sizes {sorted(blocks)}")
    ids, offset = [], 0
    for t in traces:
        _, inverse = np.unique(t.group_ids(), return_inverse=True)
        ids.append(inverse.reshape(-1) + offset)
        offset += int(inverse.max()) + 1
    return AcceptanceTrace.create(np.concatenate([t.confidence_logits for t in traces]),
                                  np.concatenate([t.num_accepted for t in traces]),
                                  np.concatenate(ids))


def split_by_request(trace: AcceptanceTrace, fit_fraction: float = 0.5,
                     seed: int = 0) -> tuple[AcceptanceTrace, AcceptanceTrace]:
    """Seeded split into (fitting, held-out) traces; all rounds of a request go to one side.

    ``round(fit_fraction * R)`` of the ``R`` requests (at least 1, at most ``R - 1``),
    chosen by a permutation from ``numpy.random.default_rng(seed)``, form the fitting split.

    Raises:
      ValueError: ``fit_fraction`` outside ``(0, 1)`` or fewer than two requests.
    """
    trace.validate()
    if not 0.0 < fit_fraction < 1.0:
        raise ValueError(f"fit_fraction must be in (0, 1), got {fit_fraction}")
    groups = np.unique(trace.group_ids())
    if groups.size < 2:
        raise ValueError("a held-out split needs at least two requests in the trace")
    num_fit = int(np.clip(round(fit_fraction * groups.size), 1, groups.size - 1))
    fit_groups = np.random.default_rng(seed).permutation(groups)[:num_fit]
    in_fit = np.isin(trace.group_ids(), fit_groups)
    return trace.select(in_fit), trace.select(~in_fit)
