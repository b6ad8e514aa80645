"""Speculative against autoregressive decoding in the same engine, and the loop's overhead.

Issue: "On SmolLM2-135M-Instruct with a trained drafter, on prompts from gsm8k, humaneval and
mt-bench: wall-clock speedup of speculative over autoregressive decoding in the same engine,
batch 1 and batch 8, and the ratio of that speedup to the ideal
tau * t_ar_step / (t_draft + t_verify) measured in the same run (goal >= 0.9: the loop adds
little)."

    python benchmarks/bench_speculative.py

(options: --drafter PATH --batches 1 8 --temperature 0 --max-new-tokens 64 --repeats 15
--warmup 1 --context-extra 32 --layer-weights stacked|unstacked --weight-dtype bfloat16
--draft-weight-dtype bfloat16
--output benchmarks/results/speculative.json)

Target: SmolLM2-135M-Instruct (``load_target``, the backend's default dtype: float32 on CPU).
Drafter: ``--drafter PATH`` (``load_drafter``), else an untrained one,
``init_drafter(target, config=configs/dspark_smollm2_135m.py get_config(), seed=0)``. With an
untrained drafter tau is about 1, so speculative decoding is slower than autoregressive; the
ratio to the ideal still measures what the loop adds on top of one draft step + one verify
step per round.

Prompts: first user turns (chat template) of gsm8k, humaneval and mt-bench from
``../shared/data/eval``, taken round-robin (gsm8k[0], humaneval[0], mt-bench[0], gsm8k[1], ...).
Batch 1 runs each of the first 3 prompts alone and sums wall times, tokens, steps and rounds;
batch 8 runs the first 8 as one batch.

Per call of ``dspark_jax.generate`` (compilation excluded by the engine; with ``--warmup 1``
one untimed call per compiled program first; AR and SPEC alternated ``--engine-repeats`` times,
the median call kept):

* AR: no drafter -> wall, new tokens, steps (target forwards after the prefill).
* SPEC: with the drafter, ``verify="full"`` -> wall, new tokens, loop iterations (``steps``),
  per-row rounds and tau (sum of the per-row ``tau_sum`` / sum of rounds).
* ``speedup = (spec tokens / spec wall) / (ar tokens / ar wall)``, end to end.

In isolation, per generate call shape (b rows, prompt width W, P proposals per block,
S = W + max_new_tokens + P + 1 cache slots, as in the engine), jitted, compiled, warmed up
(3 calls) and timed ``--repeats`` times alternating (the order flips every repeat), medians:

* ``t_prefill``: the prompts through an empty cache, LM head at each row's last token.
* ``t_verify``: one target forward of P + 1 tokens at positions
  prompt_len + ``--context-extra`` + [0..P] per row through a KV cache of S slots (donated and
  threaded through the calls), returning the logits and the drafter's taps.
* ``t_draft``: one ``DSparkModel.draft`` (P + 1 new context taps, draft cache of S slots) +
  ``sample_draft`` (LM head + block sampler) for the same rows, at the run's temperature, over
  the drafter's draft vocabulary when its folder has one (``draft_vocab.json``).

The decode phase is the wall less the prefill (SPEC: less the first draft too):
``t_ar_step = AR decode / AR steps``, ``loop / round = SPEC decode / loop iterations``,
``decode speedup`` from the two decode phases, ``ideal = tau * t_ar_step / (t_draft +
t_verify)`` and ``ratio = decode speedup / ideal``. The ratio factors into two parts:

* ``loop efficiency = (t_draft + t_verify) / loop per round``: what the loop adds to one draft
  and one verify step (policy, rejection sampling, bookkeeping, the bucket switch);
* ``straggler = (AR steps / SPEC iterations) / tau``: the loop iterations actually saved
  against the saving tau promises. A static batch runs until its slowest row is done, and
  rows that finished early idle, so at batch 8 it drops below 1.

For batch 1 the three prompts' isolated step times are averaged weighted by their loop
iterations, and their prefills summed.
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

import numpy as np

from _common import (ROOT, alternating_samples, command_line, cpu_name, draft_step, prefill_step,
                     timed, verify_step)

DATASETS = ("gsm8k", "humaneval", "mt-bench")


def load_prompts(data_dir: Path, count: int) -> list[tuple[str, str]]:
    """(dataset, first user turn) round-robin over DATASETS."""
    per = {}
    for name in DATASETS:
        with open(data_dir / f"{name}.jsonl") as f:
            per[name] = [json.loads(line)["turns"][0] for line, _ in zip(f, range(count))]
    return [(DATASETS[i % len(DATASETS)], per[DATASETS[i % len(DATASETS)]][i // len(DATASETS)])
            for i in range(count)]


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--drafter", type=Path, default=None,
                        help="trained drafter folder (load_drafter); default: untrained, seed 0")
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data" / "eval")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1, choices=(0, 1),
                        help="one untimed generate call per compiled program before timing")
    parser.add_argument("--repeats", type=int, default=15,
                        help="timed samples of the isolated verify / draft steps (>= 10)")
    parser.add_argument("--context-extra", type=int, default=32,
                        help="isolated steps run at context length prompt length + this")
    parser.add_argument("--engine-repeats", type=int, default=3,
                        help="AR / SPEC generate calls per prompt group, alternated (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weight-dtype", choices=["bfloat16"],
                        help="the target's weight matrices in this dtype, in both engines and the "
                             "isolated steps (Engine(weight_dtype=); default: as loaded)")
    parser.add_argument("--draft-weight-dtype", choices=["bfloat16"],
                        help="the drafter's weight matrices in this dtype in the engine and the "
                             "isolated draft step (Engine(draft_weight_dtype=); default: as loaded)")
    parser.add_argument("--layer-weights", choices=["stacked", "unstacked"],
                        help="layout of the target's layer weights in every program "
                             "(Target.inference_state; default: the engine's for the batch)")
    parser.add_argument("--output", type=Path,
                        default=ROOT / "benchmarks" / "results" / "speculative.json")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    sys.path.insert(0, str(ROOT))
    import dspark_jax
    from configs.dspark_smollm2_135m import get_config
    from dspark_jax import engine as engine_lib
    from dspark_jax.decoding.sampling import SamplingParams
    from dspark_jax.drafter import init_drafter, load_drafter
    from dspark_jax.prompts import encode_prompts, prompt_bucket
    from dspark_jax.models.kv_cache import KVCache
    from dspark_jax.models.layer_weights import default_layout

    started = time.perf_counter()
    load_start = list(os.getloadavg())
    target = dspark_jax.load_target(args.model)
    if args.drafter is not None:
        drafter = load_drafter(args.drafter, target)
        drafter_desc = f"trained, loaded from {args.drafter}: {drafter!r}"
    else:
        drafter = init_drafter(target, config=get_config(), seed=0)
        drafter_desc = (f"untrained: init_drafter(target, configs/dspark_smollm2_135m.py, seed=0): "
                        f"{drafter!r}")
    print(drafter_desc, flush=True)
    tcfg = target.config
    dcfg = drafter.config
    proposals = drafter.num_proposals
    top = proposals + 1
    taps_ids = tuple(dcfg.target_layer_ids)
    rng = np.random.default_rng(0)
    n_max = args.max_new_tokens

    prompts = load_prompts(args.data_dir, max(max(args.batches), 3))
    encoded = encode_prompts(target, [text for _, text in prompts])

    # -- isolated steps -------------------------------------------------------------------------
    verify = verify_step(target, taps_ids)
    draft = draft_step(target)
    vocab = engine_lib.draft_vocab(target, drafter, args.draft_weight_dtype)  # None: no draft_vocab.json
    d_state = drafter.inference_state(args.draft_weight_dtype)
    prefill = prefill_step(target, taps_ids)

    def random_cache(cache):
        return cache.replace(**{name: jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype)
                                for name, x in (("k", cache.k), ("v", cache.v))})

    def isolated_steps(ids: list[list[int]]) -> dict:
        """Median t_verify / t_draft for the generate call of these prompts."""
        b = len(ids)
        width = prompt_bucket(max(len(p) for p in ids))
        slots = width + n_max + top  # the speculative engine's cache size
        lens = np.array([len(p) for p in ids])
        anchor_pos = np.minimum(lens + args.context_extra, slots - top)
        state = {
            "t_cache": random_cache(KVCache.zeros(tcfg.num_hidden_layers, b, slots,
                                                  tcfg.num_key_value_heads, tcfg.head_dim,
                                                  target.dtype)),
            "d_cache": random_cache(drafter.model.init_cache(b, slots)),
            "p_cache": KVCache.zeros(tcfg.num_hidden_layers, b, slots, tcfg.num_key_value_heads,
                                     tcfg.head_dim, target.dtype),
        }
        prompt_tokens = np.zeros((b, width), np.int32)
        for i, p in enumerate(ids):
            prompt_tokens[i, :len(p)] = p
        prompt_tokens, prompt_lens = jnp.asarray(prompt_tokens), jnp.asarray(lens, jnp.int32)
        tokens = jnp.asarray(rng.integers(0, tcfg.vocab_size, (b, top)), jnp.int32)
        positions = jnp.asarray(anchor_pos[:, None] + np.arange(top), jnp.int32)
        ctx_taps = jnp.asarray(rng.standard_normal((b, top, len(taps_ids) * tcfg.hidden_size)),
                               target.dtype)
        ctx_pos = jnp.asarray(anchor_pos[:, None] - 1 + np.arange(top), jnp.int32)
        anchor = jnp.asarray(rng.integers(0, tcfg.vocab_size, (b,)), jnp.int32)
        apos = jnp.asarray(anchor_pos, jnp.int32)
        params = SamplingParams.broadcast(b, args.temperature, 1.0, 0)
        key = jax.random.key(args.seed)
        t_state = target.inference_state(
            args.layer_weights or default_layout(target.state, b, args.weight_dtype),
            args.weight_dtype)

        def run_verify():
            logits, taps, state["t_cache"] = verify(t_state, state["t_cache"], tokens,
                                                    positions)
            return logits, taps

        def run_draft():
            sample, state["d_cache"] = draft(drafter.graphdef, d_state, t_state,
                                             state["d_cache"], ctx_taps, ctx_pos, anchor, apos,
                                             key, params.temperature, params.top_p,
                                             params.top_k, vocab)
            return sample

        def run_prefill():
            logits, taps, state["p_cache"] = prefill(t_state, state["p_cache"],
                                                     prompt_tokens, prompt_lens)
            return logits, taps

        variants = {"verify": run_verify, "draft": run_draft, "prefill": run_prefill}
        compile_s = {name: timed(fn) for name, fn in variants.items()}
        for _ in range(3):
            for fn in variants.values():
                timed(fn)
        samples = alternating_samples(variants, args.repeats)
        return dict(
            width=width, slots=slots, context=anchor_pos.tolist(), compile_s=compile_s,
            t_verify=statistics.median(samples["verify"]),
            t_draft=statistics.median(samples["draft"]),
            t_prefill=statistics.median(samples["prefill"]),
            t_draft_first=statistics.median(samples["draft"]),  # the draft after the prefill
            iqr_s={n: (float(np.percentile(v, 25)), float(np.percentile(v, 75)))
                   for n, v in samples.items()})

    # -- engine runs ----------------------------------------------------------------------------
    warmed = set()

    def run_generate(ids, spec: bool):
        kwargs = dict(max_new_tokens=n_max, temperature=args.temperature, seed=args.seed,
                      layer_weights=args.layer_weights, weight_dtype=args.weight_dtype)
        if spec:
            kwargs.update(drafter=drafter, verify="full", draft_weight_dtype=args.draft_weight_dtype)
        key = (spec, len(ids), prompt_bucket(max(len(p) for p in ids)))
        compile_s = 0.0
        if args.warmup and key not in warmed:
            first = dspark_jax.generate(target, ids, **kwargs)
            compile_s = first[0].stats["compile_s"]
            warmed.add(key)
        res = dspark_jax.generate(target, ids, **kwargs)
        compile_s += res[0].stats["compile_s"]
        s0 = res[0].stats
        out = dict(wall_s=s0["wall_s"], tokens=sum(r.stats["new_tokens"] for r in res),
                   steps=s0["steps"], compile_s=compile_s, token_ids=[r.token_ids for r in res])
        if spec:
            out["rounds"] = sum(r.stats["counters"]["rounds"] for r in res)
            out["tau_sum"] = sum(r.stats["counters"]["tau_sum"] for r in res)
            out["accepted"] = sum(r.stats["counters"]["accepted"] for r in res)
        return out

    def run_pair(ids) -> tuple[dict, dict]:
        """AR and SPEC calls alternated ``--engine-repeats`` times (the order flips every
        repeat); each keeps the call with the median wall, and every wall in ``walls_s``."""
        runs = {False: [], True: []}
        for i in range(args.engine_repeats):
            for spec in ((False, True) if i % 2 == 0 else (True, False)):
                runs[spec].append(run_generate(ids, spec))
        picked = []
        for spec in (False, True):
            ordered = sorted(runs[spec], key=lambda r: r["wall_s"])
            median = dict(ordered[len(ordered) // 2], walls_s=[r["wall_s"] for r in runs[spec]])
            picked.append(median)
        return picked[0], picked[1]

    def derive(ar, spec, iso) -> dict:
        """Metrics from summed AR / SPEC counts and isolated step times (iteration-weighted
        t_verify / t_draft, summed t_prefill)."""
        # The decode phase: the wall less the prefill (and, for SPEC, the first draft).
        ar_decode = ar["wall_s"] - iso["t_prefill"]
        spec_decode = spec["wall_s"] - iso["t_prefill"] - iso["t_draft_first"]
        t_ar_step = ar_decode / ar["steps"]
        tau = spec["tau_sum"] / spec["rounds"]
        step = iso["t_draft"] + iso["t_verify"]
        speedup = (spec["tokens"] / spec["wall_s"]) / (ar["tokens"] / ar["wall_s"])
        decode_speedup = (spec["tokens"] / spec_decode) / (ar["tokens"] / ar_decode)
        ideal = tau * t_ar_step / step
        loop_round = spec_decode / spec["steps"]
        # Loop iterations saved: tau when every row commits tau tokens per round, less when
        # rows finish at different rounds (a static batch runs until its last row is done).
        tau_batch = ar["steps"] / spec["steps"]
        return dict(ar_tokens=ar["tokens"], ar_wall_s=ar["wall_s"], ar_steps=ar["steps"],
                    ar_tokens_per_s=ar["tokens"] / ar["wall_s"], t_ar_step=t_ar_step,
                    spec_tokens=spec["tokens"], spec_wall_s=spec["wall_s"],
                    spec_loop_iterations=spec["steps"], spec_rounds=spec["rounds"],
                    spec_accepted=spec["accepted"], spec_tokens_per_s=spec["tokens"] / spec["wall_s"],
                    tau=tau, t_verify=iso["t_verify"], t_draft=iso["t_draft"],
                    t_prefill=iso["t_prefill"], t_draft_plus_verify=step, speedup=speedup,
                    decode_speedup=decode_speedup, ideal=ideal, ratio=decode_speedup / ideal,
                    loop_per_round=loop_round, loop_efficiency=step / loop_round,
                    tau_batch=tau_batch, straggler=tau_batch / tau)

    rows = []
    for batch in args.batches:
        groups = [[i] for i in range(3)] if batch == 1 else [list(range(batch))]
        parts = []
        for group in groups:
            ids = [encoded[i] for i in group]
            load = os.getloadavg()[0]
            ar, spec = run_pair(ids)
            iso = isolated_steps(ids)
            match = sum(a == s for a, s in zip(ar.pop("token_ids"), spec.pop("token_ids")))
            part = dict(prompts=[f"{prompts[i][0]}[{i // 3}]" for i in group],
                        prompt_tokens=[len(encoded[i]) for i in group], load_average_1m=load,
                        outputs_equal=f"{match}/{len(group)}", ar=ar, spec=spec, isolated=iso)
            part.update(derive(ar, spec, iso))
            parts.append(part)
            print(f"batch {batch} {', '.join(part['prompts'])}: AR {ar['tokens']} tok "
                  f"{ar['wall_s']:.2f} s {ar['steps']} steps | SPEC {spec['tokens']} tok "
                  f"{spec['wall_s']:.2f} s {spec['steps']} iters tau {part['tau']:.3f} | verify "
                  f"{1e3 * iso['t_verify']:.1f} ms draft {1e3 * iso['t_draft']:.1f} ms | "
                  f"prefill {1e3 * iso['t_prefill']:.1f} ms | speedup {part['speedup']:.3f} decode "
                  f"{part['decode_speedup']:.3f} ideal {part['ideal']:.3f} ratio "
                  f"{part['ratio']:.3f} loop efficiency {part['loop_efficiency']:.3f} straggler "
                  f"{part['straggler']:.3f} | outputs equal {part['outputs_equal']}", flush=True)
        ar = {k: sum(p["ar"][k] for p in parts) for k in ("wall_s", "tokens", "steps")}
        spec = {k: sum(p["spec"][k] for p in parts)
                for k in ("wall_s", "tokens", "steps", "rounds", "tau_sum", "accepted")}
        iters = [p["spec"]["steps"] for p in parts]
        iso = {k: sum(n * p["isolated"][k] for n, p in zip(iters, parts)) / sum(iters)
               for k in ("t_verify", "t_draft")}
        iso.update({k: sum(p["isolated"][k] for p in parts) for k in ("t_prefill", "t_draft_first")})
        row = dict(batch=batch, groups=parts)
        row.update(derive(ar, spec, iso))
        rows.append(row)

    ms = lambda s: f"{1e3 * s:.1f}"  # noqa: E731
    drafter_short = "trained" if args.drafter is not None else "untrained (seed 0)"
    lines = [
        f"SmolLM2-135M-Instruct {np.dtype(target.dtype).name}, {jax.default_backend()}, drafter "
        f"{drafter_short}, block {dcfg.block_size} (P = {proposals}), temperature "
        f"{args.temperature:g}, max_new_tokens {n_max}; times in ms, isolated steps median of "
        f"{args.repeats}",
        "",
        "| batch | prompts | AR tok/s | SPEC tok/s | speedup | decode speedup | tau | t_prefill "
        "| t_ar_step | t_verify | t_draft | ideal | decode speedup / ideal | loop / round "
        "| loop efficiency | AR steps / SPEC iterations | straggler |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def line(batch, label, r):
        return (f"| {batch} | {label} | {r['ar_tokens_per_s']:.2f} | {r['spec_tokens_per_s']:.2f} | "
                f"{r['speedup']:.3f} | {r['decode_speedup']:.3f} | {r['tau']:.3f} | "
                f"{ms(r['t_prefill'])} | {ms(r['t_ar_step'])} | {ms(r['t_verify'])} | "
                f"{ms(r['t_draft'])} | {r['ideal']:.3f} | **{r['ratio']:.3f}** | "
                f"{ms(r['loop_per_round'])} | **{r['loop_efficiency']:.3f}** | "
                f"{r['tau_batch']:.3f} | {r['straggler']:.3f} |")

    for r in rows:
        if len(r["groups"]) > 1:
            for p in r["groups"]:
                lines.append(line(r["batch"], p["prompts"][0], p))
            lines.append(line(r["batch"], "**sum of 3**", r))
        else:
            lines.append(line(r["batch"], "+".join(r["groups"][0]["prompts"]), r))
    table = "\n".join(lines)
    print()
    print(table)

    report = dict(
        benchmark="speculative", model=args.model, dtype=np.dtype(target.dtype).name,
        backend=jax.default_backend(), drafter=drafter_desc,
        drafter_config=dcfg.as_configdict().to_dict() if hasattr(dcfg, "as_configdict") else dcfg,
        proposals=proposals, verify="full", temperature=args.temperature,
        max_new_tokens=n_max, batches=args.batches, warmup=args.warmup, repeats=args.repeats,
        engine_repeats=args.engine_repeats,
        context_extra=args.context_extra, seed=args.seed, layer_weights=args.layer_weights or "default",
        weight_dtype=args.weight_dtype or np.dtype(target.dtype).name,
        draft_weight_dtype=args.draft_weight_dtype or np.dtype(drafter.dtype).name,
        machine=f"{platform.machine()} {cpu_name()}", cpus=os.cpu_count(),
        load_average_start=load_start, load_average_end=list(os.getloadavg()),
        jax=jax.__version__, date=time.strftime("%Y-%m-%d %H:%M:%S"), command=command_line(__file__),
        wall_s=time.perf_counter() - started, rows=rows, table=table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2, default=str))
    print(f"\nwrote {args.output} ({report['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
