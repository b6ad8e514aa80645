"""Speculative statistics from a request's counters (``decoding.round.Counters``, read back)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

COUNTERS = ("rounds", "tau_sum", "accepted", "proposal_len_sum", "accepted_ge", "proposal_len_ge",
            "reached")


def _ratio(num, den):
    return float(num) / float(den) if den else None


def stats_from_counters(counters: dict) -> dict:
    """Speculative statistics (DSPARK_SPEC.md section 7, Metrics) from summed counters.

    tau: mean over rounds of accepted + 1 (accepted only when an accepted EOS ends the round);
    proposal_len: drafts verified per round; verify_rate: accepted / (verified drafts + rounds);
    accept_rate_at_k[k-1]: rounds with more than k-1 accepted among rounds verifying more than
    k-1 (prefix survival at position k); conditional_acceptance[k-1]: accepted at k among rounds
    whose first k-1 were accepted and that verified position k (paper Fig. 2). ``counters``
    holds the raw sums, which add up over requests (:func:`sum_counters`).
    """
    c = counters
    return dict(
        rounds=c["rounds"],
        tau=_ratio(c["tau_sum"], c["rounds"]),
        accepted=c["accepted"],
        proposal_len=_ratio(c["proposal_len_sum"], c["rounds"]),
        verify_rate=_ratio(c["accepted"], c["proposal_len_sum"] + c["rounds"]),
        accept_rate_at_k=[_ratio(a, p) for a, p in zip(c["accepted_ge"], c["proposal_len_ge"])],
        conditional_acceptance=[_ratio(a, r) for a, r in zip(c["accepted_ge"], c["reached"])],
        counters=c,
    )


def sum_counters(counters: Sequence[dict]) -> dict:
    """Element-wise sum of ``stats["counters"]`` dicts (several requests or runs)."""
    if not counters:
        raise ValueError("no counters to sum")
    out = {}
    for name in COUNTERS:
        values = [c[name] for c in counters]
        out[name] = (np.sum(values, axis=0).tolist() if isinstance(values[0], list)
                     else int(sum(values)))
    return out


def row_counters(counters, row: int) -> dict:
    """One slot's counters as plain ints / lists; ``counters`` is a host (numpy) Counters."""
    return {name: getattr(counters, name)[row].tolist() for name in COUNTERS}
