"""Data regeneration throughput: `dspark-jax prepare-data`'s loss tokens per second (issue 19).

Issue 19 asks for ``prepare-data >= 300 loss tokens per second on this machine``: the rate at
which the drafter campaign's training data (a million tokens and more) is regenerated. A run
that short enough to time end to end (128 prompts, about 19,000 loss tokens) spends a third of
its wall time compiling the engine's programs, which a million-token job pays once. So this
script runs ``training.data.prepare_data`` in one process the way the command does, in two
calls over one output folder:

1. the first shard (``--shard-size`` prompts): model already loaded, programs compiled;
2. ``--shards`` more shards: the call resumes after the first (``prepare_data`` continues a
   folder after its last complete shard) with every program already compiled.

and reports loss tokens per second of each call: the second is the steady state of a long
regeneration job, the first what a short one sees. Settings are the campaign's
(``launch/regenerate_smollm2.sh``): the reference's sampling (temperature 0.7, top-p 0.8,
top-k 20), 64 rows, 160 new tokens, 512-token rows. Loss tokens per second depend on the
prompts as much as on the engine: a prompt whose answer ends early costs its prefill for few
loss tokens (math prompts 1,000-1,383 gave 60 loss tokens each, 2,400-2,527 150, the 160-token
cap). The default prompts are ShareGPT's from 12,000 on (past what the campaign regenerated;
the output folder is temporary), whose chat and code answers mostly reach the cap; the earlier
runs of BENCHMARKS.md took math prompts 2,400-2,527, of which there are too few for three
shards (``--prompts .../math_prompts.jsonl --first-prompt 2400 --shards 0`` repeats them).

    python benchmarks/bench_prepare_data.py --weight-dtypes float32 bfloat16 \
        --output benchmarks/results/prepare_data.json

Each dtype runs in a fresh output folder; the dtypes alternate call by call is not possible
(a folder's shards are sequential), so run the script twice to see the machine's drift.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from _common import ROOT, command_line, cpu_name, write_report


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=Path,
                        default=ROOT.parent / "shared" / "data" / "train" / "sharegpt_prompts.jsonl")
    parser.add_argument("--first-prompt", type=int, default=12000)
    parser.add_argument("--shard-size", type=int, default=128)
    parser.add_argument("--shards", type=int, default=2, help="shards after the first")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--weight-dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "prepare_data.json")
    args = parser.parse_args()

    import jax

    import dspark_jax
    from dspark_jax.training.data import prepare_data

    report = dict(command=command_line(__file__), date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                  cpu=cpu_name(), cores=os.cpu_count(), load_before=os.getloadavg()[0],
                  jax=jax.__version__, model=args.model, prompts=str(args.prompts),
                  shard_size=args.shard_size, batch_size=args.batch_size,
                  max_new_tokens=args.max_new_tokens, max_length=args.max_length, runs={})
    target = dspark_jax.load_target(args.model)
    settings = dict(first_prompt=args.first_prompt, batch_size=args.batch_size,
                    max_new_tokens=args.max_new_tokens, max_length=args.max_length,
                    temperature=0.7, top_p=0.8, top_k=20, shard_size=args.shard_size)
    for dtype in args.weight_dtypes:
        weight_dtype = None if dtype == "float32" else dtype
        with tempfile.TemporaryDirectory() as folder:
            calls = []
            for samples in (args.shard_size, args.shard_size * (1 + args.shards))[:1 + (args.shards > 0)]:
                done = calls[-1]["loss_tokens_total"] if calls else 0
                start = time.perf_counter()
                manifest = prepare_data(target, [str(args.prompts)], folder, max_samples=samples,
                                        weight_dtype=weight_dtype, **settings)
                seconds = time.perf_counter() - start
                tokens = manifest["num_loss_tokens"] - done
                calls.append(dict(prompts=samples - (calls[-1]["prompts_total"] if calls else 0),
                                  prompts_total=samples, loss_tokens=tokens,
                                  loss_tokens_total=manifest["num_loss_tokens"],
                                  seconds=seconds, loss_tokens_per_s=tokens / seconds))
        first, steady = calls[0], calls[1] if len(calls) > 1 else None
        report["runs"][dtype] = dict(first_shard=first, steady=steady, overall_loss_tokens_per_s=(
            calls[-1]["loss_tokens_total"] / sum(c["seconds"] for c in calls)))
        line = (f"{dtype:9s} first shard (compiles): {first['loss_tokens']} loss tokens in "
                f"{first['seconds']:.1f} s = {first['loss_tokens_per_s']:.0f}/s")
        if steady:
            line += (f"; steady ({args.shards} shards): {steady['loss_tokens']} in "
                     f"{steady['seconds']:.1f} s = {steady['loss_tokens_per_s']:.0f}/s")
        print(line, flush=True)
    write_report(report, args.output)


if __name__ == "__main__":
    main()
