"""Model parameters in an Orbax folder: the one save/restore used by targets and drafters.

The parameters go to ``<folder>/params`` as a plain nested dict; the caller writes its own
metadata (config, dtype) beside them and makes the folder atomic (``storage.write_folder``).
"""

from __future__ import annotations

from pathlib import Path

import jax
from flax import nnx

from dspark_jax.checkpoints.errors import CheckpointError

PARAMS_DIR = "params"


def save_params(folder: Path, state: nnx.State) -> None:
    """Writes ``state``'s values under ``folder/params``."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(Path(folder).resolve() / PARAMS_DIR, nnx.to_pure_dict(state))


def restore_params(folder: Path, abstract: nnx.State, dtype) -> nnx.State:
    """Fills ``abstract`` (from ``nnx.eval_shape``) with the values saved under ``folder/params``,
    cast to ``dtype``.

    Raises:
      CheckpointError: the parameters are missing, partial or do not match the shapes.
    """
    import orbax.checkpoint as ocp

    folder = Path(folder)
    wanted = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), nnx.to_pure_dict(abstract))
    with ocp.StandardCheckpointer() as ckpt:
        try:
            restored = ckpt.restore(folder.resolve() / PARAMS_DIR, wanted)
        except Exception as e:
            raise CheckpointError(f"corrupt or partial Orbax checkpoint {folder}: {e}") from e
    nnx.replace_by_pure_dict(abstract, restored)
    return abstract
