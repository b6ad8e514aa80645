"""Cost of the sequential head: the block sampler with the Markov head against rank 0.

Issue: "time of the block sampler with the Markov head against rank 0, as a share of one target
verification step of the same block, for block sizes 4, 8, 12, 16 (paper: +0.2% to +1.3%)".

    python benchmarks/bench_head_cost.py

(options: --repeats 30 --batch 1 --rank 32 --block-sizes 4 8 12 16 --context 256
--no-confidence-head --output benchmarks/results/head_cost.json)

Target: the real SmolLM2-135M-Instruct (``load_target``, float32 on CPU). Drafters: randomly
initialised from ``configs/dspark_smollm2_135m.py`` (2 draft layers, taps 1/8/14/21/27,
confidence head) with only ``block_size`` and the head changed: ``head="markov"`` with the
config's rank (32; ``--rank`` overrides, e.g. 256) against ``head="none"`` (rank 0, the DFlash
baseline; its confidence head then reads h_k alone). Both drafters share the init seed, so their
backbones are identical. Weights are random: only timings are measured, which do not depend on
the values. Every timed function is jitted, compiled and warmed up first, and each sample is one
call followed by ``jax.block_until_ready``.

Per block size B, timed per repeat in a rotating order (so machine noise hits all variants
alike), reported as medians:

* ``verify``: one target forward of B tokens at positions C..C+B-1 through a KV cache whose
  slots 0..C-1 hold a prefilled C-token context (C = ``--context``, cache of C + max(B) slots,
  donated and threaded through the calls), returning the taps the drafter needs and the
  float32 logits [b, B, V] the verification needs.
* ``sampler(head)``: one call of ``sample_block`` alone (the ``lax.scan`` over the B proposal
  slots: head bias, temperature/top-p processing, draw, confidence logit) on fixed hidden
  states [b, B, d] and base logits [b, B, V]; temperature 1.0, top-p 1.0, and greedy
  (temperature 0) as a second column. Same compiled function for both (the parameters are
  traced).
* ``draft(head)``: the whole draft step ``DSparkModel.draft`` (B new context taps written into
  a draft cache of the same size, the block attending to C context slots) + base logits
  ``target.logits`` + ``sample_block``, temperature 1.0.

Derived: ``extra = sampler(markov) - sampler(none)``, ``extra / verify``, and for the full step
``(draft(markov) - draft(none)) / (draft(none) + verify)``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from _common import ROOT, command_line, cpu_name, draft_step, timed, verify_step



def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=30, help="timed samples per variant (>= 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls after compilation")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rank", type=int, default=None,
                        help="Markov rank (default: the SmolLM2 config's, 32)")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[4, 8, 12, 16])
    parser.add_argument("--context", type=int, default=256, help="tokens already in the caches")
    parser.add_argument("--no-confidence-head", action="store_true",
                        help="drop the confidence head from both drafters")
    parser.add_argument("--output", type=Path,
                        default=ROOT / "benchmarks" / "results" / "head_cost.json")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    sys.path.insert(0, str(ROOT))
    from configs.dspark_smollm2_135m import get_config
    from dspark_jax.decoding.block_sampler import sample_block
    from dspark_jax.drafter import init_drafter
    from dspark_jax.models.kv_cache import KVCache
    from dspark_jax.target import load_target

    started = time.perf_counter()
    target = load_target(args.model, dtype=jnp.float32)
    tcfg = target.config
    config = get_config()
    rank = args.rank if args.rank is not None else int(config.drafter.markov_rank)
    b, ctx_len = args.batch, args.context
    slots = ctx_len + max(args.block_sizes)
    taps_ids = tuple(config.drafter.target_layer_ids)
    rng = np.random.default_rng(0)
    vocab, d = tcfg.vocab_size, tcfg.hidden_size

    # -- target verification step (same function for every block size; recompiles per shape) --
    verify = verify_step(target, taps_ids)

    cache = KVCache.zeros(tcfg.num_hidden_layers, b, slots, tcfg.num_key_value_heads,
                          tcfg.head_dim, target.dtype)
    context_ids = jnp.asarray(rng.integers(0, vocab, (b, ctx_len)), jnp.int32)
    _, _, cache = verify(target.state, cache, context_ids,
                          jnp.broadcast_to(jnp.arange(ctx_len), (b, ctx_len)))
    caches = {"verify": cache}

    def sampler_impl(graphdef, state, hidden, base, anchor, key, temperature, top_p):
        model = nnx.merge(graphdef, state)
        return sample_block(head=model.markov_head, confidence_head=model.confidence_head,
                            confidence_with_markov=model.config.confidence_head_with_markov,
                            hidden=hidden, base_logits=base, anchor_tokens=anchor, key=key,
                            temperature=temperature, top_p=top_p)

    sampler = jax.jit(sampler_impl, static_argnums=(0,))
    draft = draft_step(target)

    one, zero = jnp.float32(1.0), jnp.float32(0.0)
    key = jax.random.key(0)
    anchor = jnp.asarray(rng.integers(0, vocab, (b,)), jnp.int32)
    rows = []
    for block in args.block_sizes:
        heads = {"none": dict(head="none", markov_rank=0), "markov": dict(head="markov", markov_rank=rank)}
        drafters = {}
        for name, over in heads.items():
            extra = dict(confidence_head=False) if args.no_confidence_head else {}
            drafters[name] = init_drafter(target, config, seed=0, block_size=block, **over, **extra)
        dcfg = drafters["markov"].config
        proposals = block - (0 if dcfg.anchor_predicts else 1)

        tokens = jnp.asarray(rng.integers(0, vocab, (b, block)), jnp.int32)
        positions = jnp.broadcast_to(ctx_len + jnp.arange(block), (b, block))
        hidden = jnp.asarray(rng.standard_normal((b, proposals, d)), jnp.float32)
        base = target.model.logits(hidden)  # realistic base logits: lm_head of the hidden states
        ctx_taps = jnp.asarray(rng.standard_normal((b, block, len(taps_ids) * d)), jnp.float32)
        ctx_pos = jnp.broadcast_to(ctx_len - block + jnp.arange(block), (b, block))
        anchor_pos = jnp.full((b,), ctx_len, jnp.int32)
        for name, dr in drafters.items():
            caches[f"draft_{name}"] = dr.model.init_cache(b, slots)

        def run_verify():
            logits, taps, caches["verify"] = verify(target.state, caches["verify"], tokens, positions)
            return logits, taps

        def make_sampler(name, temperature):
            dr = drafters[name]
            return lambda: sampler(dr.graphdef, dr.state, hidden, base, anchor, key, temperature, one)

        def make_draft(name):
            dr = drafters[name]

            def run():
                sample, caches[f"draft_{name}"] = draft(
                    dr.graphdef, dr.state, target.state, caches[f"draft_{name}"], ctx_taps,
                    ctx_pos, anchor, anchor_pos, key, one, one, 0)
                return sample
            return run

        variants = {"verify": run_verify}
        for name in heads:
            variants[f"sampler_{name}"] = make_sampler(name, one)
            variants[f"sampler_greedy_{name}"] = make_sampler(name, zero)
            variants[f"draft_{name}"] = make_draft(name)

        compile_s = {}
        for name, fn in variants.items():
            compile_s[name] = timed(fn)  # first call: trace + compile + run
            for _ in range(args.warmup):
                timed(fn)
        samples = {name: [] for name in variants}
        order = list(variants)
        for i in range(args.repeats):
            shift = i % len(order)
            for name in order[shift:] + order[:shift]:  # rotate the order every repeat
                samples[name].append(timed(variants[name]))
        med = {name: statistics.median(v) for name, v in samples.items()}
        iqr = {name: (float(np.percentile(v, 25)), float(np.percentile(v, 75)))
               for name, v in samples.items()}
        row = dict(block_size=block, proposals=proposals, median_s=med, iqr_s=iqr,
                   compile_s=compile_s)
        row["sampler_extra_s"] = med["sampler_markov"] - med["sampler_none"]
        row["sampler_extra_pct_of_verify"] = 100 * row["sampler_extra_s"] / med["verify"]
        row["greedy_sampler_extra_s"] = med["sampler_greedy_markov"] - med["sampler_greedy_none"]
        row["greedy_sampler_extra_pct_of_verify"] = 100 * row["greedy_sampler_extra_s"] / med["verify"]
        row["draft_extra_s"] = med["draft_markov"] - med["draft_none"]
        row["draft_extra_pct_of_step"] = 100 * row["draft_extra_s"] / (med["draft_none"] + med["verify"])
        # Paired estimate: per-repeat differences (same repeat, adjacent in time), then median.
        row["sampler_extra_paired_s"] = statistics.median(
            m - n for m, n in zip(samples["sampler_markov"], samples["sampler_none"]))
        row["draft_extra_paired_s"] = statistics.median(
            m - n for m, n in zip(samples["draft_markov"], samples["draft_none"]))
        rows.append(row)
        print(f"block {block}: verify {1e3 * med['verify']:.2f} ms, sampler none "
              f"{1e3 * med['sampler_none']:.3f} / markov {1e3 * med['sampler_markov']:.3f} ms, "
              f"draft none {1e3 * med['draft_none']:.2f} / markov {1e3 * med['draft_markov']:.2f} ms",
              flush=True)

    ms = lambda s: f"{1e3 * s:.3f}"  # noqa: E731
    lines = [
        f"SmolLM2-135M float32, {jax.default_backend()}, batch {b}, context {ctx_len}, Markov rank "
        f"{rank}, confidence head {'off' if args.no_confidence_head else 'on'}, median of "
        f"{args.repeats} (ms)",
        "",
        "| B | verify | sampler none | sampler markov | extra | extra / verify | greedy extra / verify "
        "| draft none | draft markov | draft extra / (draft none + verify) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r["median_s"]
        lines.append(
            f"| {r['block_size']} | {ms(m['verify'])} | {ms(m['sampler_none'])} | "
            f"{ms(m['sampler_markov'])} | {ms(r['sampler_extra_s'])} | "
            f"{r['sampler_extra_pct_of_verify']:+.2f}% | {r['greedy_sampler_extra_pct_of_verify']:+.2f}% | "
            f"{ms(m['draft_none'])} | {ms(m['draft_markov'])} | {r['draft_extra_pct_of_step']:+.2f}% |")
    table = "\n".join(lines)
    print()
    print(table)

    report = dict(
        benchmark="head_cost", model=args.model, dtype="float32", backend=jax.default_backend(),
        batch=b, context=ctx_len, cache_slots=slots, markov_rank=rank,
        draft_layers=int(config.drafter.num_layers),
        confidence_head=not args.no_confidence_head, repeats=args.repeats, warmup=args.warmup,
        machine=f"{platform.machine()} {cpu_name()}", cpus=os.cpu_count(),
        load_average=list(os.getloadavg()), jax=jax.__version__,
        date=time.strftime("%Y-%m-%d %H:%M:%S"), command=command_line(__file__),
        wall_s=time.perf_counter() - started, rows=rows, table=table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.output} ({report['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
