"""Layer weight matrices held one array per layer, which a layer scan's matmuls read in place.

A ``lax.scan`` over stacked layers slices each layer's weights out of the [L, in, out] arrays
for its matmuls, and XLA:CPU's dot cannot read a dynamic slice in place: every decode step
copies all the weight matrices once before multiplying by them (BENCHMARKS.md, issue 19: 38 ms
of a 60 ms batch-1 SmolLM2 step on one of this project's machines). Held as L arrays, a layer's
matmul is a ``lax.switch`` over L branches, branch j multiplying by array j, which XLA hands to
the dot as it is. Only the matmuls sit in the branches: the layer body is still traced and
compiled once, unlike an unrolled layer loop.

It pays where a step's matmuls have few rows, whose time the copies dominate: on a 2-core
Xeon the 30 layers' matmuls of SmolLM2-135M took 32 / 32 / 33 / 38 ms stacked and 16 / 23 /
30 / 40 ms unstacked for 1 / 2 / 4 / 8 rows (BENCHMARKS.md), and compiling takes 1.6-1.9x as
long. So an engine of at most :data:`MAX_ROWS` slots on a single CPU device reads its target's
weights this way (:func:`default_layout`); larger batches, training, meshes and accelerators
keep the stacked arrays. Where ``cpu_matmul``'s kernel runs (x86 with AVX-512), a switch
branch's float32 product of up to 32 rows is that kernel, which reads the array once for all
rows, and engines of up to 32 slots unstack.

:func:`with_dtype` holds the matrices in another dtype than the model's (bfloat16 under a
float32 model: each matmul multiplies in bfloat16 and accumulates in float32), which
:class:`Layouts` combines with either layout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.models import cpu_matmul

LAYOUTS = ("stacked", "unstacked")
MAX_ROWS = 4  # the most slots for which default_layout unstacks


@jax.tree_util.register_pytree_node_class
class Unstacked:
    """One stacked matrix [L, in, out] held as L arrays [in, out] (the leaves of this pytree),
    or, ``transposed``, as L arrays [out, in] (:func:`with_layout`)."""

    def __init__(self, layers, transposed: bool = False):
        self.layers, self.transposed = tuple(layers), transposed

    def tree_flatten(self):
        return self.layers, self.transposed

    @classmethod
    def tree_unflatten(cls, transposed, layers):
        return cls(layers, transposed)

    @property
    def shape(self) -> tuple[int, ...]:
        """The stacked matrix's shape [L, in, out] (whichever way its arrays are held)."""
        shape = tuple(self.layers[0].shape)
        return (len(self.layers),) + (shape[::-1] if self.transposed else shape)

    @property
    def dtype(self):
        return self.layers[0].dtype

    def run(self, first: int, end: int) -> "Unstacked":
        """Layers [first, end) (static): a layer scan over part of a stack switches over those
        only, so each matmul compiles one branch per layer of the run."""
        return Unstacked(self.layers[first:end], self.transposed)

    def at(self, index: jax.Array) -> "LayerKernel":
        """Layer ``index`` (traced int [], within these layers) of the matrix, for its matmuls."""
        return LayerKernel(self.layers, index, self.transposed)


@jax.tree_util.register_pytree_node_class
class LayerKernel:
    """One layer's matrix inside a layer scan: the L arrays ([in, out], or [out, in] when
    ``transposed``) and the layer's traced index, used only through :meth:`einsum` (there is
    no array to read without copying it)."""

    def __init__(self, layers, index, transposed: bool = False):
        self.layers, self.index, self.transposed = tuple(layers), index, transposed

    def tree_flatten(self):
        return (self.layers, self.index), self.transposed

    @classmethod
    def tree_unflatten(cls, transposed, children):
        return cls(*children, transposed)

    @property
    def dtype(self):
        return self.layers[0].dtype

    def einsum(self, spec: str, x: jax.Array, preferred_element_type=None) -> jax.Array:
        """``jnp.einsum(spec, x, matrix, preferred_element_type=...)`` of this layer's matrix
        [in, out] read in place, e.g. "...i,io->...o": x [..., in] -> [..., out]."""
        if spec == "...i,io->...o" and cpu_matmul.applies(x, self.layers[0],
                                                            preferred_element_type,
                                                            self.transposed):
            return cpu_matmul.layer_matmul(x, self.layers, self.index, self.transposed)
        if self.transposed:  # the operand's subscripts as its arrays hold them: [out, in]
            inputs, out = spec.split("->")
            operand, matrix = inputs.split(",")
            spec = f"{operand},{matrix[::-1]}->{out}"
        branches = [functools.partial(_einsum_with, spec, j, preferred_element_type)
                    for j in range(len(self.layers))]
        return jax.lax.switch(self.index, branches, x, self.layers)


def _einsum_with(spec: str, j: int, preferred_element_type, x: jax.Array,
                 layers: tuple) -> jax.Array:
    return jnp.einsum(spec, x, layers[j], preferred_element_type=preferred_element_type)


def is_unstacked(x) -> bool:
    return isinstance(x, Unstacked)


def run_of(x, first: int, end: int):
    """A stacked leaf as a scan over layers [first, end) reads it: an :class:`Unstacked`
    matrix cut to those layers, an array whole (indexed by absolute layer, no copy)."""
    return x.run(first, end) if isinstance(x, Unstacked) else x


def layer(x, index: jax.Array, first: int = 0):
    """Layer ``index`` (traced int, of the whole stack) of a leaf from :func:`run_of` inside
    a scan over layers from ``first``: a :class:`LayerKernel` of an Unstacked matrix, a dynamic
    slice of an array (a copy on XLA:CPU)."""
    if isinstance(x, Unstacked):
        return x.at(index - first)
    return jax.lax.dynamic_index_in_dim(x, index, keepdims=False)


def default_layout(state: nnx.State, rows: int, dtype=None, forward_rows: int | None = None
                   ) -> str:
    """"unstacked" where the scan's slices are copies that cost: every weight whole on one CPU
    device and at most :data:`MAX_ROWS` rows (an engine's slots: a step then runs 1 to 4
    rows per forward, or up to 4 (P + 1) with a drafter, where the layouts run level and only
    the compile time is longer), or a widest forward (``forward_rows``, default ``rows``: an
    engine's slots x (P + 1) with a drafter) of at most ``cpu_matmul.MAX_ROWS`` float32 rows
    where that kernel runs (it reads per-layer arrays in place: batch 8 / 16 / 32 greedy
    SmolLM2 decoded 1.32x / 1.23x / 1.06x as fast as over the stacks, while a verify of 64
    rows ran slower than over them, BENCHMARKS.md), or any rows with the
    matrices in another ``dtype`` than float32 (:func:`with_dtype`: XLA:CPU's bfloat16 matmul
    of a copied slice runs at about half the speed of a float32 one, of an array read in place
    at about twice); "stacked" otherwise."""
    devices = {d for x in jax.tree.leaves(state) if getattr(x, "sharding", None) is not None
               for d in x.sharding.device_set}
    on_one_cpu = len(devices) == 1 and next(iter(devices)).platform == "cpu"
    low_precision = dtype is not None and jnp.dtype(dtype) != jnp.dtype(jnp.float32)
    widest = rows if forward_rows is None else forward_rows
    kernel = not low_precision and widest <= cpu_matmul.MAX_ROWS and cpu_matmul.available()
    return ("unstacked" if on_one_cpu and (rows <= MAX_ROWS or low_precision or kernel)
            else "stacked")


def with_layout(state: nnx.State, stack_names: tuple[str, ...], layout: str) -> nnx.State:
    """``state`` with the matrices [L, in, out] under ``stack_names`` (a decoder's layer
    stacks) held as :class:`Unstacked` for ``layout`` "unstacked", unchanged for "stacked".
    Float32 matrices that ``cpu_matmul``'s kernel multiplies are held transposed, [out, in]:
    the kernel's product then reads each thread's share of a matrix as one contiguous run,
    where a row of [in, out] splits between the threads; batch-1 greedy SmolLM2 decodes
    1.11-1.15x as fast and a verify of 8 tokens takes 14% less time, 16 rows and batch 8 run
    level (BENCHMARKS.md, "Layer matrices held [out, in]"). The arrays are new buffers (one
    copy of the weights, made once); the rest is shared."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layer weight layout {layout!r}; known: {LAYOUTS}")
    if layout == "stacked":
        return state

    def split(path, variable):
        value = variable.get_value()
        if (path[0] in stack_names and path[-1] == "kernel" and not isinstance(value, Unstacked)
                and value.ndim == 3):
            transposed = value.dtype == jnp.float32 and cpu_matmul.available()
            return variable.replace(Unstacked(
                (value[i].T if transposed else value[i] for i in range(value.shape[0])),
                transposed))
        return variable

    return jax.tree_util.tree_map_with_path(
        lambda path, v: split(tuple(getattr(k, "key", k) for k in path), v), state,
        is_leaf=lambda x: isinstance(x, nnx.Variable))


DECODER_MATRICES = (("embed_tokens", "embedding"), ("lm_head",))  # a decoder's other matrices


def with_dtype(state: nnx.State, stack_names: tuple[str, ...], dtype,
               matrices: tuple[tuple[str, ...], ...] = DECODER_MATRICES) -> nnx.State:
    """``state`` with its weight matrices in ``dtype`` (None: unchanged): the layer stacks'
    matrices [L, in, out] under ``stack_names`` and the matrices at the paths ``matrices`` (a
    decoder's embedding table and untied LM head; a drafter's context projection).
    Norm scales, biases and the activations stay as they are, so with bfloat16 matrices under
    a float32 model every matmul multiplies in bfloat16 and accumulates in float32
    (``layers.Linear``, ``Decoder.logits``) and the embedding rows are read back in float32.
    On a CPU with AMX, XLA:CPU runs such matmuls of 4 to 32 rows 1.4-2.2x as fast as float32
    ones and of one row at about half their speed (BENCHMARKS.md, "bfloat16 weight matrices on
    a CPU"); ``cpu_matmul``'s AMX kernel takes those of up to 64 rows. New buffers (one more copy of the matrices, made once); the rest is shared."""
    if dtype is None:
        return state
    dtype = jnp.dtype(dtype)

    def cast(path, variable):
        value = variable.get_value()
        matrix = ((path[0] in stack_names and path[-1] == "kernel" and value.ndim == 3)
                  or path in matrices)
        return variable.replace(value.astype(dtype)) if matrix and value.dtype != dtype else variable

    return jax.tree_util.tree_map_with_path(
        lambda path, v: cast(tuple(getattr(k, "key", k) for k in path), v), state,
        is_leaf=lambda x: isinstance(x, nnx.Variable))


class Layouts:
    """A model's state in each layout and weight dtype it was asked for, made once per state:
    when the owner's ``state`` is replaced, the next :meth:`get` makes them anew (and drops the
    old). A copy does not follow in-place changes of the stacked arrays (``Variable.set_value``)."""

    def __init__(self, stack_names: tuple[str, ...],
                 matrices: tuple[tuple[str, ...], ...] = DECODER_MATRICES):
        self.stack_names, self.matrices = stack_names, matrices
        self._source, self._made = None, {}

    def get(self, state: nnx.State, layout: str, dtype=None) -> nnx.State:
        """``state`` in ``layout`` (:func:`with_layout`) with its matrices in ``dtype``
        (:func:`with_dtype`; None: as they are), over the owner's stack names and matrices."""
        if self._source is not state:
            self._source, self._made = state, {}
        key = (layout, None if dtype is None else jnp.dtype(dtype).name)
        if key not in self._made:
            self._made[key] = with_layout(with_dtype(state, self.stack_names, dtype, self.matrices),
                                          self.stack_names, layout)
        return self._made[key]
