"""Logical axis names -> mesh axes, the one table shared by serving and training.

Every parameter carries logical axis names (``out_sharding`` metadata). The mesh has the axes
``data`` (requests / sequences), ``fsdp`` (parameter sharding) and ``tensor`` (heads, MLP,
vocabulary). Under ``jax.set_mesh(mesh)`` the loaders place parameters with these rules; a
dimension that does not divide evenly over its mesh axes stays replicated.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("layers", None),
    ("norm", None),
    ("head_dim", None),
    # drafter-only axes: small, replicated
    ("taps", None),
    ("markov_rank", None),
    ("head_in", None),
    ("confidence", None),
)


def make_mesh(shape: tuple[int, int, int] = (-1, 1, 1), devices=None) -> jax.sharding.Mesh:
    """A (data, fsdp, tensor) mesh; one -1 entry takes the remaining devices."""
    devices = devices or jax.devices()
    shape = list(shape)
    if -1 in shape:
        known = int(np.prod([s for s in shape if s != -1]))
        shape[shape.index(-1)] = len(devices) // known
    if int(np.prod(shape)) != len(devices):
        raise ValueError(f"mesh shape {tuple(shape)} does not use the {len(devices)} devices")
    # Auto axes: the compiler propagates the parameter shardings through the model. (JAX's
    # default, Explicit, would need an out_sharding on every gather and matmul of the model.)
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh(tuple(shape), MESH_AXES, auto, devices=devices)


def logical_to_spec(names, shape, mesh, rules=LOGICAL_AXIS_RULES) -> PartitionSpec:
    """PartitionSpec for an array with logical axis ``names``; uneven dims stay replicated."""
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name, size in zip(names, shape):
        axes = table.get(name)
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        axes = tuple(a for a in axes if a in mesh.shape and a not in used)
        if axes and size % int(np.prod([mesh.shape[a] for a in axes])) == 0:
            used.update(axes)
            spec.append(axes[0] if len(axes) == 1 else axes)
        else:
            spec.append(None)
    return PartitionSpec(*spec)


def state_shardings(state: nnx.State, mesh, rules=LOGICAL_AXIS_RULES):
    """A pytree of NamedShardings matching ``state`` (from each parameter's axis names)."""
    def one(var):
        names = var.get_metadata().get("out_sharding") or (None,) * var.get_value().ndim
        spec = logical_to_spec(names, var.get_value().shape, mesh, rules)
        return var.replace(NamedSharding(mesh, spec))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def unsharded_init():
    """Context in which models are built without the ambient ``jax.set_mesh`` mesh.

    Inside a mesh flax would read the parameters' logical axis names ("vocab", "embed", ...)
    as mesh axes; models are built here and placed afterwards with :func:`shard_state`.
    """
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ()))


def current_mesh():
    """The concrete mesh set with ``jax.set_mesh``, or None."""
    mesh = jax.sharding.get_mesh()
    return None if mesh is None or mesh.empty else mesh


def shard_state(state: nnx.State, mesh=None, rules=LOGICAL_AXIS_RULES) -> nnx.State:
    """Places ``state`` on ``mesh`` (default: the current ``jax.set_mesh`` mesh, if any)."""
    mesh = mesh or current_mesh()
    if mesh is None:
        return state
    return jax.device_put(state, state_shardings(state, mesh, rules))



def constrain(x: jax.Array, names) -> jax.Array:
    """Inside jit under ``jax.set_mesh``: shard ``x`` by its logical axis ``names`` (uneven dims
    replicated; all None replicates it); a no-op without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, x.shape, mesh))


def constrain_rows(x: jax.Array, axis: int = 0) -> jax.Array:
    """Inside jit under ``jax.set_mesh``: shard ``x``'s request axis over the data axes (data
    parallel over requests); a no-op without a mesh or when the rows do not divide evenly."""
    names = [None] * x.ndim
    names[axis] = "batch"
    return constrain(x, names)
