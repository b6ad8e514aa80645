"""bfloat16 products of M rows: this host's bfloat16 kernel against XLA's dot and float32.

Times one product x [M, K] @ w (bfloat16 operands, float32 result) of each of SmolLM2-135M's
matrix shapes, the layer matrices as w [K, N] (q/k/v/o as one [576, 1536], gate/up [576, 3072],
down [1536, 576]) and the tied LM head as w [N, K] = [49152, 576], for each M: through the
kernel (``cpu_matmul._kernel``, whatever ``cpu_matmul.applies`` says: ``cpu_matmul_amx.cc`` on
a CPU with AMX, ``cpu_matmul_bf16.cc`` on one with AVX-512 BF16 only), through ``jnp.einsum``
with a float32 result (XLA:CPU's dot), and for comparison the same product in float32 (the
float32 kernel up to its ``cpu_matmul.MAX_ROWS`` rows, else XLA's dot: the CPU default the
bfloat16 weights compete with), alternating in one process. Each figure
is the best of ``--repeats`` jitted loops of 20 products of the same matrix, so the matrix
stays in the caches: this is the products' compute, not the decode step's weight streaming
(``bench_ar_generate.py``). On AMX it chose ``cpu_matmul.BF16_MAX_ROWS`` = 64 (the kernel then
took any number of rows, commit dc8ad4e; at 128 and 512 rows XLA's dot was as fast or faster,
BENCHMARKS.md; this script was ``amx_rows.py`` then); rows are at most that now:

    python benchmarks/bf16_rows.py --rows 1 8 16 17 32 64
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from _common import ROOT, command_line, cpu_name, write_report

SHAPES = {"qkvo": (576, 1536, False), "gate_up": (576, 3072, False), "down": (1536, 576, False),
          "lm_head": (49152, 576, True)}  # name: (w's shape, transpose_w)
LOOP = 20


def seconds(product, x, w, repeats: int) -> float:
    """Best seconds per product over ``repeats`` jitted loops of :data:`LOOP` products."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def loop(x, w):
        def body(_, acc):  # each product depends on the last, so none is hoisted or skipped
            return acc + product(x + (acc[:, :1] * 0).astype(x.dtype), w)[:, :1]
        return jax.lax.fori_loop(0, LOOP, body, jnp.zeros((x.shape[0], 1), jnp.float32))

    loop(x, w).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        loop(x, w).block_until_ready()
        best = min(best, (time.perf_counter() - start) / LOOP)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 17, 32, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path,
                        default=ROOT / "benchmarks" / "results" / "bf16_rows.json")
    args = parser.parse_args()

    import jax.numpy as jnp
    import numpy as np

    from dspark_jax.models import cpu_matmul

    kernel = cpu_matmul.bfloat16_kernel()
    if kernel is None:
        raise SystemExit("no bfloat16 kernel runs here (cpu_matmul.bfloat16_kernel())")
    if max(args.rows) > cpu_matmul.BF16_MAX_ROWS or min(args.rows) < 1:
        raise SystemExit(f"--rows must lie in 1..{cpu_matmul.BF16_MAX_ROWS} (the kernel's rows)")
    rng = np.random.default_rng(0)
    report = dict(command=command_line(__file__), cpu=cpu_name(), cores=os.cpu_count(),
                  date=time.strftime("%Y-%m-%d %H:%M"), load_before=os.getloadavg()[0],
                  kernel=kernel.source, bf16_max_rows=cpu_matmul.BF16_MAX_ROWS, rows=[])
    for name, (a, b, transpose_w) in SHAPES.items():
        w32 = jnp.asarray(0.02 * rng.standard_normal((a, b)), jnp.float32)
        w = w32.astype(jnp.bfloat16)
        for m in args.rows:
            x32 = jnp.asarray(rng.standard_normal((m, b if transpose_w else a)), jnp.float32)
            x = x32.astype(jnp.bfloat16)
            ours = seconds(lambda x, w: cpu_matmul._kernel(x, w, transpose_w), x, w, args.repeats)
            xla = seconds(lambda x, w: cpu_matmul._einsum(x, w, transpose_w), x, w, args.repeats)
            f32 = seconds(lambda x, w: cpu_matmul.matmul(x, w, transpose_w), x32, w32,
                          args.repeats)
            row = dict(matrix=name, rows=m, kernel_ms=1e3 * ours, xla_ms=1e3 * xla,
                       float32_ms=1e3 * f32, xla_over_kernel=xla / ours,
                       float32_over_kernel=f32 / ours)
            report["rows"].append(row)
            print(f"{name:8s} {m:4d} rows: kernel {row['kernel_ms']:7.3f} ms, "
                  f"XLA {row['xla_ms']:7.3f} ms ({row['xla_over_kernel']:.2f}x), "
                  f"float32 {row['float32_ms']:7.3f} ms ({row['float32_over_kernel']:.2f}x)",
                  flush=True)
    write_report(report, args.output)


if __name__ == "__main__":
    main()
