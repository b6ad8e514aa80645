"""dspark-jax: DSpark speculative decoding in JAX/Flax.

Public API:
  load_target(source, dtype=None) -> Target
  generate(target, prompts, *, max_new_tokens, temperature=0.0, top_p=1.0, top_k=0, seed=0,
           drafter=None, verify="full", verify_params=None, buckets=None, record=False,
           max_batch=None, progress=None) -> list[GenerationResult]
  init_drafter(target, config=None, *, seed=0, dtype=None, **overrides) -> Drafter
  load_drafter(path_or_packaged_name, target, dtype=None) -> Drafter
  Drafter.save(path, layout="deepspec" | "dflash" | "orbax", *, dtype=None, target_tensors=True)
  Drafter.calibrate(temperatures, fit=None)
"""

import logging


class _NoTorchNotice(logging.Filter):
    """Drops transformers' import-time notice "PyTorch was not found. ...": dspark-jax uses
    only its tokenizers and configs, so the notice is noise. Every other message passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("PyTorch was not found.")


# transformers logs the notice on its root logger ("transformers") when it is first imported,
# which happens lazily (the tokenizer of a target): install the filter before that.
logging.getLogger("transformers").addFilter(_NoTorchNotice())

from dspark_jax.generation import GenerationResult, generate  # noqa: E402
from dspark_jax.target import Target, load_target  # noqa: E402
from dspark_jax.drafter import Drafter, init_drafter, load_drafter  # noqa: E402

__all__ = ["Drafter", "GenerationResult", "Target", "generate", "init_drafter", "load_drafter",
           "load_target"]
__version__ = "0.1.0"
