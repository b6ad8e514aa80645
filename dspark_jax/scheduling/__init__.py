"""Verification-length scheduling: static baselines, Algorithm 1, async global search."""

from dspark_jax.scheduling.policies import (
    expected_throughput,
    fixed_proposal_len,
    full_block_proposal_len,
    global_search_capacity,
    prefix_schedule,
    production_schedule,
    survivals,
    threshold_proposal_len,
    throughput_curve,
    top_k_prefix_schedule,
)

__all__ = [
    "expected_throughput",
    "fixed_proposal_len",
    "full_block_proposal_len",
    "global_search_capacity",
    "prefix_schedule",
    "production_schedule",
    "survivals",
    "threshold_proposal_len",
    "throughput_curve",
    "top_k_prefix_schedule",
]
