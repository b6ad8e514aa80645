"""Continuous-batching serving: the engine, a closed-loop load generator and serve-bench."""

from dspark_jax.serving.engine import Engine, Request, machine_sps_table, token_buckets

__all__ = ["Engine", "Request", "machine_sps_table", "token_buckets"]
