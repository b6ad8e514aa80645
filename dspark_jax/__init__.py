"""dspark-jax: DSpark speculative decoding in JAX/Flax.

Public API:
  load_target(source, dtype=None) -> Target
  generate(target, prompts, *, max_new_tokens, temperature=0.0, top_p=1.0, top_k=0, seed=0,
           drafter=None) -> list[GenerationResult]
"""

from dspark_jax.generation import GenerationResult, generate
from dspark_jax.target import Target, load_target

__all__ = ["GenerationResult", "Target", "generate", "load_target"]
__version__ = "0.1.0"
