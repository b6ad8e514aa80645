"""A prefill's cost with its attention by the einsum and by ``cpu_attention``'s row kernel
(issue 19).

The engine admits prompts through ``ragged_forward`` over an empty cache: every row one
prompt, attended causally within the row. On a CPU that attention was the einsum
(``layers.attend``), which materialises [B, K, G, W, W] float32 score blocks and reads them
five times; the "cpu" implementation (``fused_attention.attend_segments`` ->
``cpu_attention.attend_rows``) keeps a block of queries' scores in the cache.

    python benchmarks/prefill_attention.py
    (options: --model smollm2-135m-instruct --batches 1 16 64 --widths 128 512
     --weight-dtypes float32 bfloat16 --repeats 3
     --output benchmarks/results/prefill_attention.json)

For each weight dtype (the engine's decoding state, ``Target.inference_state``), batch B and
width W: one jitted prefill of B prompts of W random tokens each (positions 0 .. W - 1, the
dense grid), the LM head at each row's last token, as ``decoding.round.prefill`` runs it; once
per attention implementation. Every program is compiled and warmed up (one call), then timed
``--repeats`` rounds calling every program once, in an order that reverses every round;
medians. Reported: ms per prefill, prompt tokens per second, the kernel's speedup, and the
largest difference of the last tokens' logits between the two: float32 rounding with float32
weights; with bfloat16 weights each product rounds its activations to bfloat16, so the
attention's last-bit differences become bfloat16 steps that the layers spread (0.1-0.4 of the
logits of random tokens).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from _common import ROOT, alternating_samples, command_line, cpu_name, grid_prefill, write_report

IMPLEMENTATIONS = ("einsum", "cpu")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--widths", type=int, nargs="+", default=[128, 512],
                        help="prompt tokens per row")
    parser.add_argument("--weight-dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path,
                        default=ROOT / "benchmarks" / "results" / "prefill_attention.json")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    from flax import nnx

    sys.path.insert(0, str(ROOT))
    import dspark_jax
    from dspark_jax.models import cpu_attention
    from dspark_jax.models.layer_weights import default_layout

    if not cpu_attention.available():
        sys.exit("cpu_attention's kernel is not available here (x86 with AVX-512 and a C++ "
                 "compiler needed)")
    load_start = list(os.getloadavg())
    target = dspark_jax.load_target(args.model)
    cfg = target.config
    rng = np.random.default_rng(0)

    def prefill_of(impl: str, rows: int, width: int):
        def prefill(state, tokens):  # tokens [rows * width], the dense grid
            model = nnx.merge(target.graphdef, state)
            out = grid_prefill(model, tokens.reshape(rows, width), target.dtype, True,
                               attention=impl)
            return model.logits(out.hidden.reshape(rows, width, -1)[:, -1])

        return jax.jit(prefill)

    calls, logits, compile_s = {}, {}, {}
    for dtype, rows, width in itertools.product(args.weight_dtypes, args.batches, args.widths):
        wd = None if dtype == np.dtype(target.dtype).name else dtype
        state = target.inference_state(default_layout(target.state, rows, wd), wd)
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, rows * width), jnp.int32)
        for impl in IMPLEMENTATIONS:
            fn = prefill_of(impl, rows, width)
            key = (dtype, rows, width, impl)
            calls[key] = lambda fn=fn, state=state, tokens=tokens: fn(state, tokens)
            start = time.perf_counter()
            logits[key] = np.asarray(calls[key]())
            compile_s["/".join(map(str, key))] = time.perf_counter() - start

    samples = alternating_samples(calls, args.repeats)
    ms = {key: 1e3 * statistics.median(v) for key, v in samples.items()}

    report = dict(command=command_line(__file__), date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                  cpu=cpu_name(), cores=os.cpu_count(), load_avg_start=load_start,
                  jax=jax.__version__, model=args.model, repeats=args.repeats,
                  compile_s=compile_s, cases=[])
    for dtype, rows, width in itertools.product(args.weight_dtypes, args.batches, args.widths):
        einsum, kernel = (ms[(dtype, rows, width, impl)] for impl in IMPLEMENTATIONS)
        diff = float(np.abs(logits[(dtype, rows, width, "cpu")]
                            - logits[(dtype, rows, width, "einsum")]).max())
        case = dict(weight_dtype=dtype, batch=rows, width=width, einsum_ms=einsum,
                    cpu_ms=kernel, speedup=einsum / kernel,
                    tokens_per_s={"einsum": rows * width / einsum * 1e3,
                                  "cpu": rows * width / kernel * 1e3},
                    max_logit_diff=diff)
        report["cases"].append(case)
        print(f"{dtype:9s} batch {rows:3d} x {width:4d} tokens: einsum {einsum:8.1f} ms, "
              f"kernel {kernel:8.1f} ms ({case['speedup']:.2f}x; "
              f"{case['tokens_per_s']['cpu']:7.0f} tokens/s), logits within {diff:.1e}",
              flush=True)
    write_report(report, args.output)


if __name__ == "__main__":
    main()
