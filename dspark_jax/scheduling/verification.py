"""Verification policies: how many draft tokens each request verifies this round.

One interface for every policy: ``proposal_len = policy_proposal_len(policy, confidences,
lagged, active, params)``, all inside the jitted decode loop. ``confidences`` are the per-step confidence
probabilities c_k = sigmoid(z_k) of the current block (1 when the drafter has no confidence
head); c_k is computed before x_k is sampled from x_{k-1} and h_k, so cutting at k uses only
information available before the tokens it cuts. ``lagged`` are the confidences of the block
that was verified two rounds earlier (the production scheduler's capacity search), and ones in
a request's first two rounds (``decoding.round.NO_HISTORY``: a prior, not the request's current
block, whose c_{k+1} depends on the drafted x_k; paper Appendix A): a new request's capacity is
then what the steps/s table allows.

Policies (``policy`` is static, ``params`` are traced arrays):

* ``"full"``: verify the whole block.
* ``"fixed"``: verify ``params["gamma"]`` tokens (gamma 1 is the MTP-1 analogue).
* ``"threshold"``: the reference's static truncation (``params["threshold"]``; <= 0 keeps all).
* ``"prefix"``: Algorithm 1 against the steps/s table ``params["sps"]`` (see
  :mod:`dspark_jax.scheduling`).
* ``"production"``: the Sec. 5.2 variant (capacity from the lagged confidences).
* a callable ``fn(confidences, lagged, active, params) -> int32 [b]``: the hook for any other
  scheduler; it must be a hashable, pure JAX function.
"""

from __future__ import annotations

import warnings
from typing import Callable

import jax.numpy as jnp
import numpy as np

from dspark_jax.scheduling import policies as scheduling

POLICIES = ("full", "fixed", "threshold", "prefix", "production")


def default_params(policy, batch: int, proposals: int, params: dict | None = None,
                   confidence_temperatures=None) -> dict:
    """Traced parameters of a policy with defaults filled in.

    Defaults: gamma = block, threshold 0 (keep all), and a flat steps/s table covering every
    possible forward size (so the scheduler admits every positive-survival token; ``prefix``
    and ``production`` warn that they then verify like ``full``).
    ``confidence_temperatures`` [P] are the drafter's STS temperatures (default 1): every
    policy sees c_k = sigmoid(z_k / T_k).
    """
    params = dict(params or {})
    temps = (np.ones((proposals,), np.float32) if confidence_temperatures is None
             else np.asarray(confidence_temperatures, np.float32))
    if temps.shape != (proposals,) or not np.all(temps > 0):
        raise ValueError(f"confidence temperatures must be {proposals} positive numbers, got "
                         f"{temps.tolist()}")
    out = dict(gamma=jnp.asarray(params.pop("gamma", proposals), jnp.int32),
               threshold=jnp.asarray(params.pop("threshold", 0.0), jnp.float32),
               confidence_temperatures=jnp.asarray(temps))
    sps = params.pop("sps", None)
    if sps is None and policy in ("prefix", "production"):
        warnings.warn(f"verify={policy!r} without a steps/s table: a flat table makes it verify "
                      "every draft with positive survival, as 'full' does. Pass {'sps': table} "
                      "(`dspark-jax profile-sps`, or `--sps auto` on the command line)",
                      UserWarning, stacklevel=3)
    out["sps"] = (jnp.ones((batch * (proposals + 1) + 1,), jnp.float32) if sps is None
                  else jnp.asarray(sps, jnp.float32))
    if params:
        raise ValueError(f"unknown verification parameter(s): {', '.join(sorted(params))}")
    if not callable(policy) and policy not in POLICIES:
        raise ValueError(f"unknown verification policy {policy!r}; choose one of "
                         f"{', '.join(POLICIES)} or pass a function")
    return out


def policy_proposal_len(policy: str | Callable, confidences, lagged, active, params: dict):
    """Draft tokens each row verifies: int32 [b] in 0..P (0 for inactive rows).

    Args:
      confidences, lagged: float [b, P] per-step confidence probabilities of the current block /
        of the block verified two rounds earlier (ones in a request's first two rounds).
      active: bool [b] rows still generating.
      params: from :func:`default_params`. ``prefix`` and ``production`` score the engine's
        flat verify of sum(1 + n_b) tokens, what is run.
    """
    batch, proposals = confidences.shape
    if callable(policy):
        proposal_len = policy(confidences, lagged, active, params)
    elif policy == "full":
        proposal_len = scheduling.full_block_proposal_len(batch, proposals, active)
    elif policy == "fixed":
        proposal_len = scheduling.fixed_proposal_len(batch, proposals, params["gamma"], active)
    elif policy == "threshold":
        proposal_len = scheduling.threshold_proposal_len(confidences, params["threshold"], active)
    elif policy == "prefix":
        proposal_len = scheduling.prefix_schedule(confidences, params["sps"], active)
    else:
        proposal_len = scheduling.production_schedule(confidences, lagged, params["sps"], active)
    return jnp.where(active, jnp.clip(proposal_len, 0, proposals), 0).astype(jnp.int32)
