"""The one engine: continuous batching over slots, with or without a drafter."""

from dspark_jax.engine.engine import (Engine, Request, clear_compiled_programs, compiled_programs,
                                      draft_vocab, machine_sps_table, token_buckets)

__all__ = ["Engine", "Request", "clear_compiled_programs", "compiled_programs", "draft_vocab",
           "machine_sps_table", "token_buckets"]
