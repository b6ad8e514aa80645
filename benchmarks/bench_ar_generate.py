"""Greedy autoregressive decoding: dspark_jax.generate against transformers' generate.

Same model (SmolLM2-135M-Instruct, the weights dspark-jax converted from the GGUF, float32),
same chat prompts (gsm8k and mt-bench from ../shared/data/eval), same machine, measured in one
run; reported as tokens/s ratios. Compile time of the jitted loop is reported separately.

    python benchmarks/bench_ar_generate.py --max-new-tokens 96 --batches 1 8 --repeats 5

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


ROOT = Path(__file__).resolve().parents[1]


def load_prompts(data_dir: Path, count: int) -> list[str]:
    """First user turns: half from gsm8k, half from mt-bench."""
    def first_turns(name, n):
        with open(data_dir / name) as f:
            return [json.loads(line)["turns"][0] for line, _ in zip(f, range(n))]

    half = (count + 1) // 2
    return first_turns("gsm8k.jsonl", half) + first_turns("mt-bench.jsonl", count - half)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data" / "eval")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "ar_generate.json")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    import dspark_jax
    from dspark_jax.checkpoints import registry
    from dspark_jax.generation import encode_prompts

    target = dspark_jax.load_target(args.model)
    hf_folder = registry.converted_folder(args.model) if args.model in registry.REGISTRY else args.model
    hf_model = AutoModelForCausalLM.from_pretrained(str(hf_folder), dtype=torch.float32).eval()
    prompts = load_prompts(args.data_dir, max(args.batches))
    encoded = encode_prompts(target, prompts)
    pad = target.tokenizer.pad_token_id

    load_before = os.getloadavg()
    rows = []
    for batch in args.batches:
        ids = encoded[:batch]
        # dspark-jax: the first call compiles (timed separately), then timed runs.
        first = dspark_jax.generate(target, ids, max_new_tokens=args.max_new_tokens)
        compile_s = first[0].stats["compile_s"]
        width = max(len(p) for p in ids)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in ids])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
        ours, theirs = [], []
        with torch.no_grad():
            hf_model.generate(input_ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
            for _ in range(args.repeats):  # the two alternate, so both see the same machine
                res = dspark_jax.generate(target, ids, max_new_tokens=args.max_new_tokens)
                ours.append(res[0].stats["tokens_per_s"])
                start = time.perf_counter()
                out = hf_model.generate(input_ids, attention_mask=mask, do_sample=False,
                                        max_new_tokens=args.max_new_tokens, pad_token_id=pad)
                wall = time.perf_counter() - start
                gen = out[:, width:].numpy()
                eos = set(target.eos_token_ids)
                count = 0
                for row in gen:
                    hits = [i for i, t in enumerate(row) if t in eos]
                    count += hits[0] + 1 if hits else len(row)
                theirs.append(count / wall)
        row = dict(batch=batch, dspark_tokens_per_s=statistics.median(ours),
                   hf_tokens_per_s=statistics.median(theirs), compile_s=compile_s)
        row["ratio"] = row["dspark_tokens_per_s"] / row["hf_tokens_per_s"]
        rows.append(row)
        print(f"batch {batch}: dspark-jax {row['dspark_tokens_per_s']:.1f} tok/s, transformers "
              f"{row['hf_tokens_per_s']:.1f} tok/s, ratio {row['ratio']:.2f}x, compile {compile_s:.1f} s")

    report = dict(benchmark="ar_generate", model=args.model, max_new_tokens=args.max_new_tokens,
                  repeats=args.repeats, machine=f"{platform.machine()} {platform.processor()}".strip(),
                  cpus=os.cpu_count(), load_average=dict(before=load_before, after=os.getloadavg()),
                  torch=torch.__version__,
                  jax=__import__("jax").__version__, date=time.strftime("%Y-%m-%d"), rows=rows)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
