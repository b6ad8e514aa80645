"""Continuous-batching serving: the engine, a closed-loop load generator and serve-bench."""

from dspark_jax.serving.engine import Engine, Request, token_buckets

__all__ = ["Engine", "Request", "token_buckets"]
