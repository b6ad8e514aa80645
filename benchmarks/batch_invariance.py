"""Greedy outputs across batch sizes and decoding modes, per weight dtype.

Greedy speculative decoding must reproduce greedy autoregressive decoding token for token, and
a prompt's greedy output should not depend on the prompts decoded beside it. This decodes the
same prompts greedily four ways in one process, autoregressive and speculative, one prompt at a
time and all together (``generate(max_batch=)``), and counts the prompts whose four outputs
agree, for each weight dtype asked for:

    python benchmarks/batch_invariance.py --drafter dspark-smollm2-135m-campaign \
        --weight-dtypes float32 bfloat16 --prompts 8 --max-new-tokens 96

Prompts: first user turns (chat template) of gsm8k, humaneval and mt-bench, round-robin, from
``../shared/data/eval`` (as ``bench_speculative.py``). Writes a JSON with each prompt's outputs'
agreement and, where they differ, the first token index at which they do.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from _common import ROOT, command_line, cpu_name
from bench_speculative import load_prompts

WAYS = ("ar_alone", "ar_together", "spec_alone", "spec_together")


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where a and b differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--drafter", required=True, help="trained drafter folder (load_drafter)")
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data" / "eval")
    parser.add_argument("--weight-dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--output", type=Path,
                        default=ROOT / "benchmarks" / "results" / "batch_invariance.json")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    import dspark_jax
    from dspark_jax.drafter import load_drafter

    started = time.perf_counter()
    load_start = list(os.getloadavg())
    target = dspark_jax.load_target(args.model)
    drafter = load_drafter(args.drafter, target)
    prompts = load_prompts(args.data_dir, args.prompts)
    texts = [turn for _, turn in prompts]
    record = {"command": command_line(__file__), "cpu": cpu_name(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average_start": load_start,
              "drafter": str(args.drafter), "max_new_tokens": args.max_new_tokens,
              "prompts": [name for name, _ in prompts], "dtypes": {}}
    for dtype in args.weight_dtypes:
        kw = dict(max_new_tokens=args.max_new_tokens,
                  weight_dtype=None if dtype == "float32" else dtype)
        outputs = {}
        for way in WAYS:
            mode, batch = way.split("_")
            outputs[way] = [r.token_ids for r in dspark_jax.generate(
                target, texts, drafter=drafter if mode == "spec" else None,
                max_batch=1 if batch == "alone" else len(texts), **kw)]
        rows = []
        for i, (name, _) in enumerate(prompts):
            ref = outputs["ar_alone"][i]
            differ = {way: first_difference(ref, outputs[way][i]) for way in WAYS[1:]}
            rows.append({"prompt": name, "tokens": len(ref), "first_difference": differ})
        agree = sum(all(d is None for d in r["first_difference"].values()) for r in rows)
        print(f"{dtype}: {agree}/{len(rows)} prompts decode the same tokens all four ways")
        for r in rows:
            differ = {w: d for w, d in r["first_difference"].items() if d is not None}
            if differ:
                print(f"  {r['prompt']}: first differs from ar_alone at {differ}")
        record["dtypes"][dtype] = {"agree": agree, "rows": rows}
    record["load_average_end"] = list(os.getloadavg())
    record["seconds"] = time.perf_counter() - started
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
