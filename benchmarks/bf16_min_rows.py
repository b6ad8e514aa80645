"""Batch-1 decoding with bfloat16 weight matrices, with and without padding the products to
``layers.MIN_ROWS`` rows, side by side in one process.

XLA:CPU multiplies a single bfloat16 row through a slow matrix-vector kernel whose float32
sums also differ from the many-row kernel's; ``layers.with_min_rows`` pads a 1- or 2-row
product to 3 rows. This times ``generate`` at batch 1 (greedy, eval prompts) with the padding
(``MIN_ROWS`` = 3) and without it (1), alternating, recompiling between them, with the float32
weights as the reference, and reports tokens/s and whether the outputs agree:

    python benchmarks/bf16_min_rows.py --prompts 3 --max-new-tokens 64 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from _common import ROOT, command_line, cpu_name
from bench_speculative import load_prompts

VARIANTS = (("float32", 3), ("bfloat16", 1), ("bfloat16", 3))  # (weight dtype, MIN_ROWS)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data" / "eval")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path,
                        default=ROOT / "benchmarks" / "results" / "bf16_min_rows.json")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    import dspark_jax
    from dspark_jax.engine import clear_compiled_programs
    from dspark_jax.models import layers

    load_start = list(os.getloadavg())
    target = dspark_jax.load_target(args.model)
    prompts = [turn for _, turn in load_prompts(args.data_dir, args.prompts)]

    def decode(dtype: str, min_rows: int) -> tuple[float, int, list]:
        """Seconds, tokens and outputs of the prompts decoded one at a time (a second time: the
        first call compiles)."""
        layers.MIN_ROWS = min_rows
        clear_compiled_programs()
        kw = dict(max_new_tokens=args.max_new_tokens, max_batch=1,
                  weight_dtype=None if dtype == "float32" else dtype)
        dspark_jax.generate(target, prompts, **kw)  # compile every program the prompts need
        start = time.perf_counter()
        results = dspark_jax.generate(target, prompts, **kw)
        seconds = time.perf_counter() - start
        return seconds, sum(len(r.token_ids) for r in results), [r.token_ids for r in results]

    runs = {f"{d} MIN_ROWS={m}": [] for d, m in VARIANTS}
    outputs = {}
    for _ in range(args.repeats):
        for dtype, min_rows in VARIANTS:
            seconds, tokens, out = decode(dtype, min_rows)
            name = f"{dtype} MIN_ROWS={min_rows}"
            runs[name].append(tokens / seconds)
            outputs[name] = out
            print(f"{name}: {tokens / seconds:.1f} tokens/s", flush=True)
    record = {"command": command_line(__file__), "cpu": cpu_name(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average_start": load_start,
              "load_average_end": list(os.getloadavg()), "prompts": args.prompts,
              "max_new_tokens": args.max_new_tokens, "tokens_per_s": runs,
              "median_tokens_per_s": {k: statistics.median(v) for k, v in runs.items()}}
    reference = runs["float32 MIN_ROWS=3"]
    for name, values in runs.items():
        ratio = statistics.median(v / r for v, r in zip(values, reference))
        record.setdefault("ratio_to_float32", {})[name] = ratio
        print(f"{name}: median {statistics.median(values):.1f} tokens/s, {ratio:.2f}x float32")
    padded, unpadded = outputs["bfloat16 MIN_ROWS=3"], outputs["bfloat16 MIN_ROWS=1"]
    record["bfloat16_outputs_equal"] = padded == unpadded
    record["bfloat16_equal_to_float32"] = sum(a == b for a, b in
                                              zip(padded, outputs["float32 MIN_ROWS=3"]))
    print(f"bfloat16 outputs padded == unpadded: {padded == unpadded}; "
          f"padded == float32: {record['bfloat16_equal_to_float32']}/{len(prompts)}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
