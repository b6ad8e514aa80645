"""What a verify of T tokens and a draft step cost at batch 1, in decode steps, over a long
context (issue 19).

Issue 19: "verify of k <= 8 tokens at batch 1 over a 512-token context <= 1.25 decode steps;
k = 16 <= 1.5" and "the draft step (block 7 with the Markov head and sampling) <= 0.25 decode
step". Speculative decoding gains only when a verify costs little more than a step.

    python benchmarks/verify_cost.py
    (options: --model smollm2-135m-instruct --context 512 --tokens 1 2 4 8 16
     --weight-dtypes float32 bfloat16 --drafter dspark-smollm2-135m-campaign
     --draft-weight-dtypes float32 bfloat16 --repeats 15
     --output benchmarks/results/verify_cost.json; --drafter none leaves the draft step out)

One target forward of T tokens per call, at positions context .. context + T - 1 through a KV
cache of ``round_up(context + max T, 128)`` slots holding random keys and values (the engine's
cache view at that context: its attention reads every slot), the drafter's tap layers returned
and the LM head applied to all T tokens, as the engine's verify does; the cache is donated and
threaded through the calls. T = 1 is the autoregressive decode step's forward. For each weight
dtype the target's decoding state is the engine's at batch 1
(``Target.inference_state(layer_weights.default_layout(state, 1, dtype), dtype)``).

The draft step (with ``--drafter``, in each weight dtype's target state: the drafter reads the
target's embedding and LM head rows) is the engine's: the taps of the 8 tokens a verify of 7
drafts commits go into the draft cache (random keys and values in its other slots), the block
runs through the drafter and the sequential head samples its proposals over the drafter's draft
vocabulary, greedy (``draft``) and at temperature 1 (``draft_sampled``), with the drafter's
matrices in each of ``--draft-weight-dtypes`` (``Engine(draft_weight_dtype=)``); reported as
``draft_steps`` = ms / ms(T = 1) of the same target dtype.

Every program is compiled and warmed up (3 calls), then timed ``--repeats`` rounds,
each round calling every program once in an order that reverses every round; medians. Reported
per dtype: ms per T, ``decode_steps`` = ms(T) / ms(T = 1) of the same dtype, and
``float32_steps`` = ms(T) / ms(T = 1) in float32 (when float32 is among the dtypes): what a
verify in that dtype costs against the default engine's step.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from _common import (ROOT, alternating_samples, command_line, cpu_name, draft_step, timed,
                     verify_step)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--context", type=int, default=512, help="tokens before the verified ones")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                        help="tokens per verify (T = 1: the decode step)")
    parser.add_argument("--weight-dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16"])
    parser.add_argument("--drafter", default="dspark-smollm2-135m-campaign",
                        help="drafter folder whose draft step is timed too ('none': leave it out)")
    parser.add_argument("--draft-weight-dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "verify_cost.json")
    args = parser.parse_args()
    if 1 not in args.tokens:
        parser.error("--tokens must include 1, the decode step the costs are measured in")

    import jax
    import jax.numpy as jnp

    sys.path.insert(0, str(ROOT))
    import dspark_jax
    from configs.dspark_smollm2_135m import get_config
    from dspark_jax.engine import draft_vocab
    from dspark_jax.models.kv_cache import KVCache
    from dspark_jax.models.layer_weights import default_layout

    load_start = list(os.getloadavg())
    target = dspark_jax.load_target(args.model)
    cfg = target.config
    drafter = None if args.drafter == "none" else dspark_jax.load_drafter(args.drafter, target)
    taps = tuple((get_config().drafter if drafter is None else drafter.config).target_layer_ids)
    slots = -(-(args.context + max(args.tokens)) // 128) * 128
    step = verify_step(target, taps)
    rng = np.random.default_rng(0)

    def random_cache(cache):
        return cache.replace(**{name: jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype)
                                for name, x in (("k", cache.k), ("v", cache.v))})

    if drafter is not None:
        draft = draft_step(target)
        vocabs = {name: draft_vocab(target, drafter, name) for name in args.draft_weight_dtypes}
        committed = drafter.config.block_size + 1  # the tokens a full verify of 7 commits
        ctx_taps = jnp.asarray(rng.standard_normal((1, committed, len(taps) * cfg.hidden_size)),
                               target.dtype)
        ctx_pos = jnp.asarray(args.context - committed + 1 + np.arange(committed)[None], jnp.int32)
        anchor = jnp.asarray(rng.integers(0, cfg.vocab_size, (1,)), jnp.int32)
        anchor_pos = jnp.asarray([args.context], jnp.int32)

    calls, compile_s = {}, {}
    for dtype in args.weight_dtypes:
        wd = None if dtype == np.dtype(target.dtype).name else dtype
        state = target.inference_state(default_layout(target.state, 1, wd), wd)
        for t in args.tokens:
            cache = random_cache(KVCache.zeros(cfg.num_hidden_layers, 1, slots,
                                               cfg.num_key_value_heads, cfg.head_dim, target.dtype))
            tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, t)), jnp.int32)
            positions = jnp.asarray(args.context + np.arange(t)[None], jnp.int32)
            holder = [cache]

            def call(state=state, holder=holder, tokens=tokens, positions=positions):
                logits, tap_out, holder[0] = step(state, holder[0], tokens, positions)
                return logits, tap_out

            calls[(dtype, t)] = call
        if drafter is not None:
            for draft_dtype, (name, temperature) in itertools.product(
                    args.draft_weight_dtypes, (("draft", 0.0), ("draft_sampled", 1.0))):
                holder = [random_cache(drafter.model.init_cache(1, slots))]

                def call(state=state, holder=holder, temperature=jnp.full((1,), temperature),
                         d_state=drafter.inference_state(draft_dtype), vocab=vocabs[draft_dtype]):
                    sample, holder[0] = draft(drafter.graphdef, d_state, state, holder[0],
                                              ctx_taps, ctx_pos, anchor, anchor_pos,
                                              jax.random.key(0), temperature, jnp.ones((1,)),
                                              jnp.zeros((1,), jnp.int32), vocab)
                    return sample

                calls[(dtype, f"{name}/{draft_dtype}")] = call
    for (dtype, t), call in calls.items():
        compile_s[f"{dtype}/{t}"] = timed(call)
        for _ in range(3):
            timed(call)

    samples = alternating_samples(calls, args.repeats)
    ms = {key: 1e3 * statistics.median(v) for key, v in samples.items()}

    result = dict(command=command_line(__file__), date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                  cpu=cpu_name(), cores=os.cpu_count(), load_avg_start=load_start,
                  load_avg_end=list(os.getloadavg()), jax=jax.__version__, model=args.model,
                  context=args.context, cache_slots=slots, repeats=args.repeats,
                  drafter=None if drafter is None else args.drafter, compile_s=compile_s, dtypes={})
    for dtype in args.weight_dtypes:
        row = {t: ms[(dtype, t)] for t in args.tokens}
        entry = dict(ms=row, decode_steps={t: v / row[1] for t, v in row.items()})
        if "float32" in args.weight_dtypes:
            entry["float32_steps"] = {t: v / ms[("float32", 1)] for t, v in row.items()}
        line = "  ".join(
            f"T={t}: {row[t]:6.1f} ms ({entry['decode_steps'][t]:.2f} steps"
            + (f", {entry['float32_steps'][t]:.2f} f32" if "float32_steps" in entry else "") + ")"
            for t in args.tokens)
        if drafter is not None:
            entry["draft_ms"] = {name: v for (d, name), v in ms.items()
                                 if d == dtype and str(name).startswith("draft")}
            entry["draft_steps"] = {name: v / row[1] for name, v in entry["draft_ms"].items()}
            line += "  " + "  ".join(f"{name}: {v:5.1f} ms ({entry['draft_steps'][name]:.2f} steps)"
                                     for name, v in entry["draft_ms"].items())
        result["dtypes"][dtype] = entry
        print(f"{dtype:9s} {line}", flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
