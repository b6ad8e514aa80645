"""A draft vocabulary against the whole vocabulary: the draft step's cost and the acceptance.

The draft step computes the drafter's LM head over every token it may propose; restricted to
the V' most frequent answer tokens of the training data (``dspark-jax draft-vocab``) it reads
V'/V of the vocabulary matrix, while rejection sampling keeps the output exact. This measures
both sides, side by side in one process:

    python benchmarks/bench_draft_vocab.py --data D/math D/code D/chat \
        --heldout D/heldout_math D/heldout_code D/heldout_chat --sizes 4096 8192 16384

1. Cost, per batch size (``--batches``): the isolated draft step (``_common.draft_step``: the
   drafter's forward over P + 1 new context taps, its LM head and the block sampler, at
   temperature 1) for the whole vocabulary and each V', against one decode forward of the
   target (one token per row through a cache of the same slots), medians of ``--repeats``
   round-robin calls.
2. Acceptance: ``evaluation.suite.run_benchmark`` (full-block verification, batches of
   ``--batch-size``) on the first ``--prompts`` prompts of gsm8k, humaneval and mt-bench at each
   ``--temperatures``, for the whole vocabulary and each V': tau, conditional acceptance and
   the decode's tokens/s.

The draft vocabularies come from the answer tokens of ``--data`` (training folders only),
with their coverage of ``--heldout``. Writes ``--output`` (JSON) and prints Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from _common import ROOT, command_line, cpu_name, draft_step, timed, verify_step

SETS = ("gsm8k", "humaneval", "mt-bench")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--drafter", default="dspark-smollm2-135m")
    parser.add_argument("--data", nargs="+", required=True, help="prepared training folders")
    parser.add_argument("--heldout", nargs="+", default=[], help="prepared held-out folders")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8],
                        help="none: the acceptance part only")
    parser.add_argument("--context", type=int, default=256, help="cached tokens per row")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--prompts", type=int, default=10, help="per set")
    parser.add_argument("--temperatures", type=float, nargs="*", default=[0.0, 1.0],
                        help="none: the cost part only")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--output", default=str(ROOT / "benchmarks/results/draft_vocab.json"))
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import dspark_jax
    from dspark_jax.engine import draft_vocab
    from dspark_jax.evaluation.suite import run_benchmark
    from dspark_jax.models.kv_cache import KVCache
    from dspark_jax.prompts import load_benchmark
    from dspark_jax.training.data import answer_token_counts, most_frequent

    target = dspark_jax.load_target(args.model)
    drafter = dspark_jax.load_drafter(args.drafter, target)
    counts = answer_token_counts(args.data)
    held = answer_token_counts(args.heldout) if args.heldout else None
    vocabs = {"all": None}
    coverage = {}
    for size in args.sizes:
        ids = most_frequent(counts, size)
        vocabs[str(size)] = ids
        coverage[str(size)] = dict(data=float(counts[ids].sum() / counts.sum()),
                                   heldout=None if held is None else float(held[ids].sum() / held.sum()))

    cfg, dcfg = target.config, drafter.config
    rng = np.random.default_rng(0)
    block, taps = dcfg.block_size, len(dcfg.target_layer_ids)
    draft, decode = draft_step(target), verify_step(target, ())
    cost = {}
    for b in args.batches:
        slots = args.context + 2 * block
        cache = KVCache.for_model(cfg, b, slots, target.dtype)
        context = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, args.context)), jnp.int32)
        _, _, cache = decode(target.state, cache, context,
                             jnp.broadcast_to(jnp.arange(args.context), (b, args.context)))
        state = {"decode": cache, **{name: drafter.model.init_cache(b, slots) for name in vocabs}}
        token = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, 1)), jnp.int32)
        position = jnp.full((b, 1), args.context, jnp.int32)
        ctx_taps = jnp.asarray(rng.standard_normal((b, block, taps * cfg.hidden_size)), target.dtype)
        ctx_pos = jnp.broadcast_to(args.context - block + jnp.arange(block), (b, block))
        anchor = jnp.asarray(rng.integers(0, cfg.vocab_size, (b,)), jnp.int32)
        anchor_pos = jnp.full((b,), args.context, jnp.int32)
        one = jnp.float32(1.0)

        def run_decode():
            logits, _, state["decode"] = decode(target.state, state["decode"], token, position)
            return logits

        def make_draft(name):
            drafter.restrict_vocab(vocabs[name])
            arrays = draft_vocab(target, drafter)  # gathered once, as an engine does

            def run():
                sample, state[name] = draft(drafter.graphdef, drafter.state, target.state,
                                            state[name], ctx_taps, ctx_pos, anchor, anchor_pos,
                                            jax.random.key(0), one, one, 0, arrays)
                return sample
            return run

        variants = {"decode": run_decode, **{f"draft {name}": make_draft(name) for name in vocabs}}
        for fn in variants.values():
            timed(fn), timed(fn)  # compile, warm up
        samples = {name: [] for name in variants}
        order = list(variants)
        for i in range(args.repeats):
            shift = i % len(order)
            for name in order[shift:] + order[:shift]:
                samples[name].append(timed(variants[name]))
        cost[b] = {name: statistics.median(v) for name, v in samples.items()}
        print(f"batch {b}: " + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in cost[b].items()),
              flush=True)

    acceptance = {}
    prompts = {name: load_benchmark(name, limit=args.prompts) for name in SETS}
    for temperature in args.temperatures:
        for name, ids in vocabs.items():
            drafter.restrict_vocab(ids)
            per_set = {}
            for bench, texts in prompts.items():
                stats, _ = run_benchmark(target, drafter, texts, max_new_tokens=args.max_new_tokens,
                                         temperature=temperature, batch_size=args.batch_size,
                                         desc=f"V' {name} T {temperature:g} {bench}")
                per_set[bench] = {k: stats[k] for k in ("tau", "rounds", "conditional_acceptance",
                                                        "tokens_per_s", "new_tokens")}
            acceptance[f"{temperature:g}/{name}"] = per_set
            print(f"T {temperature:g}, V' {name}: tau " + ", ".join(
                f"{b} {r['tau']:.3f}" for b, r in per_set.items()), flush=True)
    drafter.restrict_vocab(None)

    sizes = list(vocabs)
    print("\n| batch | decode forward | " + " | ".join(f"draft, V' {s}" for s in sizes) + " |")
    print("|---|---|" + "---|" * len(sizes))
    for b, row in cost.items():
        step = row["decode"]
        print(f"| {b} | {1e3 * step:.1f} ms | " + " | ".join(
            f"{1e3 * row[f'draft {s}']:.1f} ms ({row[f'draft {s}'] / step:.2f})" for s in sizes) + " |")
    print("\n| T | V' | coverage (data / held-out) | " + " | ".join(f"tau {b}" for b in SETS)
          + " | mean tau | tokens/s (mean) |")
    print("|---|---|---|" + "---|" * (len(SETS) + 2))
    for key, per_set in acceptance.items():
        temperature, name = key.split("/")
        cov = coverage.get(name)
        cov_text = "1 / 1" if cov is None else f"{cov['data']:.4f} / " + (
            "-" if cov["heldout"] is None else f"{cov['heldout']:.4f}")
        taus = [per_set[b]["tau"] for b in SETS]
        speed = [per_set[b]["tokens_per_s"] for b in SETS]
        print(f"| {temperature} | {name} | {cov_text} | " + " | ".join(f"{t:.3f}" for t in taus)
              + f" | {np.mean(taus):.3f} | {np.mean(speed):.1f} |")

    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        command=command_line(__file__, argv), machine=cpu_name(),
        date=time.strftime("%Y-%m-%d %H:%M:%S"), model=args.model, drafter=args.drafter,
        data=args.data, heldout=args.heldout, coverage=coverage,
        cost_s={str(b): row for b, row in cost.items()}, acceptance=acceptance), indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
