"""The decode step's layer matmuls alone: weight dtype, layer loop and XLA:CPU's matmul library.

Issue 19's levers for the weight-bound decode step, measured without the rest of the engine:
SmolLM2-135M's 30 layers of weight matmuls (q, k, v, o as one [576, 1536] matrix, gate and up
as one [576, 3072], down [1536, 576]; 425 MB in float32, the LM head left out), a hidden state
of ``batch`` rows carried through them 16 times in one jitted loop. Variants:

- ``float32``: float32 weights and activations (today's CPU default);
- ``bfloat16-upcast``: bfloat16 weights, converted to float32 for a float32 matmul (half the
  bytes read, float32 activations);
- ``bfloat16-dot``: bfloat16 weights and activations, float32 accumulation
  (``preferred_element_type``), as an AVX-512 BF16 path would run;

each with the layers as a ``lax.scan`` over stacked [30, ...] weights (``scan``: the engine's
loop over large batches, which copies each layer's slice before its matmul), as an unrolled
loop over per-layer arrays (``unrolled``), and as a scan whose matmuls read per-layer arrays in
place through a ``lax.switch`` over the layers (``switch``: ``models/layer_weights.py``, the
engine's loop for a few rows on a CPU).
``--forms`` writes the float32 matmul other ways (a verify of k tokens is a batch of k rows,
and XLA:CPU's small-M matmuls set its cost): ``rows`` one matrix-vector product per row,
``columns`` two matmuls over the halves of the output columns (independent, so XLA:CPU may run
them on both cores), ``reduce`` a broadcast multiply and sum that XLA fuses into one loop.
The machine's read bandwidth (a jitted sum over 1 GiB) is measured in the same run.

    python benchmarks/layer_matmuls.py --batches 1 8
    python benchmarks/layer_matmuls.py --batches 1 2 4 8 --variants float32 --loops scan switch
    python benchmarks/layer_matmuls.py --batches 8 --variants float32 --forms dot rows columns reduce
    XLA_FLAGS=--xla_cpu_use_onednn=true python benchmarks/layer_matmuls.py --batches 1 8 \
        --variants float32 --output benchmarks/results/layer_matmuls_onednn.json
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from _common import ROOT, cpu_name, read_bandwidth, write_report

LAYERS, HIDDEN, MLP = 30, 576, 1536
VARIANTS = ("float32", "bfloat16-upcast", "bfloat16-dot")
FORMS = ("dot", "rows", "columns", "reduce")
LOOPS = ("scan", "unrolled", "switch")
STEPS = 16


def layer_weights(dtype, seed: int = 0) -> dict:
    """Stacked weights {name: [LAYERS, in, out]} of SmolLM2-135M's layer shapes."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    shapes = {"attention": (HIDDEN, HIDDEN + 2 * 192 + HIDDEN), "gate_up": (HIDDEN, 2 * MLP),
              "down": (MLP, HIDDEN)}
    return {name: jnp.asarray(0.02 * rng.standard_normal((LAYERS,) + shape, np.float32), dtype)
            for name, shape in shapes.items()}


def step_seconds(variant: str, loop: str, batch: int, repeats: int,
                 form: str = "dot") -> tuple[float, int]:
    """Best seconds per pass through the 30 layers, and the weight bytes read per pass."""
    import jax
    import jax.numpy as jnp

    weights = layer_weights(jnp.float32 if variant == "float32" else jnp.bfloat16)
    if loop == "unrolled":
        weights = [{name: w[i] for name, w in weights.items()} for i in range(LAYERS)]
    if loop == "switch":
        from dspark_jax.models.layer_weights import Unstacked

        weights = {name: Unstacked(w[i] for i in range(LAYERS)) for name, w in weights.items()}

    def matmul(x, w):
        if loop == "switch":  # the engine's switch over per-layer arrays (plain dot only)
            return w.einsum("bi,io->bo", x)
        if variant == "bfloat16-upcast":
            return x @ w.astype(jnp.float32)
        if variant == "bfloat16-dot":
            return jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
        if form == "rows":
            return jnp.concatenate([x[i:i + 1] @ w for i in range(x.shape[0])])
        if form == "columns":
            half = w.shape[1] // 2
            return jnp.concatenate([x @ w[:, :half], x @ w[:, half:]], axis=1)
        if form == "reduce":
            return jnp.sum(x[:, :, None] * w[None], axis=1)
        return x @ w

    def layer(h, w):
        a = matmul(h, w["attention"])
        h = h + 0.1 * (a[:, :HIDDEN] + a[:, -HIDDEN:])
        u = matmul(h, w["gate_up"])
        return h + matmul(jax.nn.silu(u[:, :MLP]) * u[:, MLP:], w["down"]), None

    @jax.jit
    def passes(weights, h):
        def one(_, h):
            if loop == "unrolled":
                for w in weights:
                    h = layer(h, w)[0]
                return h
            if loop == "switch":
                at = lambda h, i: layer(h, {name: w.at(i) for name, w in weights.items()})
                return jax.lax.scan(at, h, jnp.arange(LAYERS))[0]
            return jax.lax.scan(layer, h, weights)[0]
        return jax.lax.fori_loop(0, STEPS, one, h)

    h = jnp.full((batch, HIDDEN), 0.1, jnp.float32)
    passes(weights, h).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        passes(weights, h).block_until_ready()
        best = min(best, (time.perf_counter() - start) / STEPS)
    return best, sum(w.nbytes for w in jax.tree.leaves(weights))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--forms", nargs="+", choices=FORMS, default=["dot"],
                        help="ways to write the float32 matmul (other variants: dot only)")
    parser.add_argument("--loops", nargs="+", choices=LOOPS, default=list(LOOPS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "layer_matmuls.json")
    args = parser.parse_args()
    report = {"machine": cpu_name(), "cores": os.cpu_count(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "date": time.strftime("%Y-%m-%d %H:%M"), "load_before": os.getloadavg()[0],
              "read_bandwidth_gb_s": read_bandwidth() / 1e9, "rows": []}
    print(f"read bandwidth {report['read_bandwidth_gb_s']:.1f} GB/s")
    for batch in args.batches:
        for variant in args.variants:
            for form in args.forms if variant == "float32" else ["dot"]:
                for loop in args.loops:
                    if loop == "switch" and (form != "dot" or variant != "float32"):
                        continue
                    seconds, nbytes = step_seconds(variant, loop, batch, args.repeats, form)
                    row = {"batch": batch, "variant": variant, "form": form,
                           "loop": loop, "ms_per_pass": 1e3 * seconds,
                           "weight_mb": nbytes / 1e6, "weight_gb_s": nbytes / seconds / 1e9}
                    report["rows"].append(row)
                    print(f"batch {batch:3d}  {variant:16s} {form:8s} {row['loop']:8s} "
                          f"{row['ms_per_pass']:7.2f} ms  {row['weight_mb']:4.0f} MB  "
                          f"{row['weight_gb_s']:5.1f} GB/s", flush=True)
    write_report(report, args.output)


if __name__ == "__main__":
    main()
