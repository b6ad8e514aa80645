"""Autoregressive decoding: dspark_jax.generate against transformers' generate.

Same model (SmolLM2-135M-Instruct, the weights dspark-jax converted from the GGUF, float32),
same chat prompts, same machine, measured in one run; reported as tokens/s ratios. Compile time
of the jitted loop is reported separately.

    python benchmarks/bench_ar_generate.py --max-new-tokens 96 --batches 1 8 --repeats 5
    python benchmarks/bench_ar_generate.py --prompt-set train-math --batches 32 \
        --modes greedy sampled --repeats 2
    python benchmarks/bench_ar_generate.py --layer-weights stacked unstacked --batches 1 8
    python benchmarks/bench_ar_generate.py --weight-dtypes float32 bfloat16 --batches 1 8 32

``--layer-weights`` times dspark-jax once per layout of the target's layer weights in the
decode programs (``Target.inference_state``: "stacked" slices each layer out of [L, ...]
arrays, which XLA:CPU copies; "unstacked" reads per-layer arrays in place), all alternating
with transformers in one run, and checks that every layout decodes the same tokens.
``--weight-dtypes float32 bfloat16`` times each layout once more with the target's weight
matrices in bfloat16 (``Engine(weight_dtype=)``: multiplied in bfloat16, accumulated in
float32), and transformers once more in bfloat16 (its weights and activations) beside its
float32 run: each dtype's tokens are compared within that dtype.

Prompts: ``eval`` takes the first user turns of gsm8k and mt-bench (../shared/data/eval),
``train-math`` those of the math training prompts (../shared/data/train), as data regeneration
decodes them. Modes: ``greedy``, and ``sampled`` at the reference's data-regeneration settings
(temperature 0.7, top-p 0.8, top-k 20; transformers' ``do_sample`` with the same warpers).

The memory roofline of batch-1 decoding is measured in the same run: the parameter bytes read
per step over this machine's read bandwidth (a jitted sum over 1 GiB of float32); with
bfloat16 weights the matrices' bytes are halved (``rooflines_tokens_per_s`` per dtype).

The two engines alternate run by run in one process (medians reported), and the load average
before and after is recorded: a figure from a loaded machine is not a result.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from _common import read_bandwidth


ROOT = Path(__file__).resolve().parents[1]


SAMPLING = {"greedy": {}, "sampled": dict(temperature=0.7, top_p=0.8, top_k=20)}


def load_prompts(data_dir: Path, prompt_set: str, count: int) -> list[str]:
    """First user turns: half gsm8k, half mt-bench (``eval``), or math training prompts."""
    def first_turns(path, n):
        with open(path) as f:
            return [json.loads(line)["turns"][0] for line, _ in zip(f, range(n))]

    if prompt_set == "train-math":
        return first_turns(data_dir / "train" / "math_prompts.jsonl", count)
    half = (count + 1) // 2
    return (first_turns(data_dir / "eval" / "gsm8k.jsonl", half)
            + first_turns(data_dir / "eval" / "mt-bench.jsonl", count - half))


def count_new_tokens(generated, eos: set[int]) -> int:
    """New tokens per row up to and including the first EOS, summed."""
    count = 0
    for row in generated:
        hits = [i for i, t in enumerate(row) if t in eos]
        count += hits[0] + 1 if hits else len(row)
    return count


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--prompt-set", choices=["eval", "train-math"], default="eval")
    parser.add_argument("--modes", nargs="+", choices=list(SAMPLING), default=["greedy"])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layer-weights", nargs="+", choices=["stacked", "unstacked"],
                        help="layouts of the target's layer weights to time (default: the backend's)")
    parser.add_argument("--weight-dtypes", nargs="+", choices=["float32", "bfloat16"],
                        default=["float32"], help="dtypes of the target's weight matrices to time")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "ar_generate.json")
    args = parser.parse_args()
    # Each way dspark-jax decodes: (layout of the layer weights, dtype of the weight matrices).
    ways = [(layout, dtype) for dtype in args.weight_dtypes
            for layout in (args.layer_weights or [None])]

    import jax
    import torch
    from transformers import AutoModelForCausalLM

    import dspark_jax
    from dspark_jax.checkpoints import registry
    from dspark_jax.prompts import encode_prompts

    target = dspark_jax.load_target(args.model)
    hf_folder = registry.converted_folder(args.model) if args.model in registry.REGISTRY else args.model
    hf_dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    hf_models = {d: AutoModelForCausalLM.from_pretrained(str(hf_folder), dtype=hf_dtypes[d]).eval()
                 for d in args.weight_dtypes}
    prompts = load_prompts(args.data_dir, args.prompt_set, max(args.batches))
    encoded = encode_prompts(target, prompts)
    pad = target.tokenizer.pad_token_id
    eos = set(target.eos_token_ids)

    load_before = os.getloadavg()
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(target.state))
    # bfloat16 weights: the matrices (every leaf of 2 or more dims) at half the bytes
    dtype_bytes = {"float32": weight_bytes, "bfloat16": sum(
        x.nbytes // 2 if x.ndim >= 2 else x.nbytes for x in jax.tree.leaves(target.state))}
    bandwidth = read_bandwidth()
    rooflines = {dtype: bandwidth / dtype_bytes[dtype] for dtype in args.weight_dtypes}
    roofline = bandwidth / weight_bytes
    print(f"parameters {weight_bytes / 1e6:.0f} MB, read bandwidth {bandwidth / 1e9:.1f} GB/s: "
          f"batch-1 memory roofline {roofline:.1f} tokens/s"
          + (f" ({rooflines['bfloat16']:.1f} in bfloat16 weights)" if "bfloat16" in rooflines
             else ""))
    rows = []
    for batch in args.batches:
        ids = encoded[:batch]
        width = max(len(p) for p in ids)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in ids])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
        for mode in args.modes:
            settings = SAMPLING[mode]
            hf_settings = (dict(do_sample=True, **settings) if settings else dict(do_sample=False))
            def ours_once(way, seed):
                layout, dtype = way
                return dspark_jax.generate(target, ids, max_new_tokens=args.max_new_tokens,
                                           seed=seed, layer_weights=layout,
                                           weight_dtype=None if dtype == "float32" else dtype,
                                           **settings)

            # dspark-jax: the first call compiles (timed separately), then timed runs.
            compile_s = {way: ours_once(way, 0)[0].stats["compile_s"] for way in ways}
            ours, tokens = {way: [] for way in ways}, {}
            theirs = {dtype: [] for dtype in args.weight_dtypes}
            with torch.no_grad():
                for hf_model in hf_models.values():
                    hf_model.generate(input_ids, attention_mask=mask, max_new_tokens=4,
                                      pad_token_id=pad, **hf_settings)
                for repeat in range(args.repeats):  # all alternate: they see the same machine
                    for way in ways:
                        res = ours_once(way, repeat)
                        ours[way].append(res[0].stats["tokens_per_s"])
                        tokens.setdefault((repeat, way[1]), []).append([r.token_ids for r in res])
                    for dtype, hf_model in hf_models.items():
                        torch.manual_seed(repeat)
                        start = time.perf_counter()
                        out = hf_model.generate(input_ids, attention_mask=mask, pad_token_id=pad,
                                                max_new_tokens=args.max_new_tokens, **hf_settings)
                        wall = time.perf_counter() - start
                        theirs[dtype].append(count_new_tokens(out[:, width:].numpy(), eos) / wall)
            layouts_agree = all(all(t == runs[0] for t in runs) for runs in tokens.values())
            for way in ways:
                layout, dtype = way
                row = dict(batch=batch, mode=mode, layer_weights=layout or "default",
                           weight_dtype=dtype, dspark_tokens_per_s=statistics.median(ours[way]),
                           hf_tokens_per_s=statistics.median(theirs["float32"] if "float32" in theirs
                                                             else theirs[dtype]),
                           hf_same_dtype_tokens_per_s=statistics.median(theirs[dtype]),
                           compile_s=compile_s[way], layouts_decode_the_same_tokens=layouts_agree)
                row["ratio"] = row["dspark_tokens_per_s"] / row["hf_tokens_per_s"]
                row["ratio_same_dtype"] = row["dspark_tokens_per_s"] / row["hf_same_dtype_tokens_per_s"]
                if batch == 1 and mode == "greedy":
                    row["fraction_of_roofline"] = row["dspark_tokens_per_s"] / rooflines[dtype]
                rows.append(row)
                print(f"batch {batch} {mode} ({row['layer_weights']}, {dtype} weights): dspark-jax "
                      f"{row['dspark_tokens_per_s']:.1f} tok/s, transformers float32 "
                      f"{row['hf_tokens_per_s']:.1f} tok/s ({row['ratio']:.2f}x), transformers "
                      f"{dtype} {row['hf_same_dtype_tokens_per_s']:.1f} tok/s "
                      f"({row['ratio_same_dtype']:.2f}x), compile {compile_s[way]:.1f} s"
                      + ("" if layouts_agree else ", LAYOUTS DECODED DIFFERENT TOKENS"), flush=True)

    report = dict(benchmark="ar_generate", model=args.model, max_new_tokens=args.max_new_tokens,
                  repeats=args.repeats, prompt_set=args.prompt_set, sampling=SAMPLING,
                  parameter_bytes=weight_bytes, read_bandwidth_gb_s=bandwidth / 1e9,
                  roofline_tokens_per_s=roofline, rooflines_tokens_per_s=rooflines, machine=f"{platform.machine()} {platform.processor()}".strip(),
                  cpus=os.cpu_count(), load_average=dict(before=load_before, after=os.getloadavg()),
                  torch=torch.__version__,
                  jax=__import__("jax").__version__, date=time.strftime("%Y-%m-%d"), rows=rows)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
