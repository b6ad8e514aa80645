"""The accelerator benchmark suite (issue 17): one prepared script, one JSON, under 8 minutes on
one NVIDIA H200.

    python benchmarks/device_suite.py --output $OUT/device_suite.json        # on the device
    python benchmarks/device_suite.py --smoke --output /tmp/suite.json         # a CPU dry run

Sections, each timed after its own compilation, each written to the JSON as soon as it is done
(a section that fails records its error, and the rest still run):

1. ``decode``: greedy autoregressive ``generate`` of a Qwen3-1.7B-shaped random target in
   bfloat16 (28 layers, d 2048, 16 heads / 8 kv heads of 128, MLP 6144, V 151,936, tied) at
   batch 1 and 64, 512-token prompts, 128 new tokens: tokens/s, and the fraction of the HBM
   roofline, (parameter bytes + KV bytes read per step) x steps/s / ``--hbm-bytes-per-s``
   (4.3 TB/s: the H200's measured device copy).
2. ``sps``: one target verify forward of T = 1, 2, 4, ..., 256 tokens at batch 1 over a
   512-token context (``_common.verify_step``): ms and cost in decode steps (T / T = 1), the
   SPS curve of the scheduler, through each ``--cache-attention`` kernel over the KV cache
   (``fused_attention.attend_cache``; on a GPU the Pallas decode kernel, the default there, and
   the einsum: ``curves``, and the kernel's speedup per T).
3. ``speculative``: the draft step (a DSpark drafter of the reference's shape: 5 layers, block
   7, Markov rank 256, confidence head; random weights) and the verify of a block at batch 1
   and 64, and the speedup they allow, tau x t_decode / (t_draft + t_verify), for tau 2 to 5.
   The packaged SmolLM2 drafters need their target's weights (a 98 MB GGUF), which cannot
   travel to the device with the working tree (64 MiB); with ``--smollm2`` (the registered
   model installed there) the packaged DSpark drafter's measured end-to-end speedup is added.
4. ``train``: the DSpark train step on that target with online target features (target forward
   inside the step), ``--train-rows`` rows of ``--train-length`` tokens, 512 anchors per row,
   bfloat16: tokens/s, and MFU = XLA's cost analysis FLOPs per step / step time /
   ``--peak-flops`` (989 TFLOP/s, the H200's dense bfloat16 peak).
5. ``attention``: the packed target forward of training (``--train-rows`` rows of
   ``--train-length`` tokens, four segments and some padding per row) through the einsum over
   the dense mask and through the backend's fused kernel (``models/fused_attention.py``: cuDNN
   on a GPU, splash on a TPU; XLA's ``jax.nn`` on a CPU), given the segments as a mask and, as
   the training forward gives them, bounded (``max_segments``: cuDNN's packed layout):
   ms each, the speedups, and the largest difference of their hidden states at real tokens.

``--smoke`` shrinks every shape (a 6-layer target, few tokens) so that the whole script runs on a
CPU in about two minutes (in float32 there: XLA:CPU lacks some bfloat16 dots): it checks the code
paths, not the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import traceback
from pathlib import Path

from _common import command_line, draft_step, verify_step

QWEN3_1_7B = dict(architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=2048,
                  intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, rope_theta=1e6, tie_word_embeddings=True,
                  max_position_embeddings=40960, eos_token_id=151645)
SMOKE = dict(QWEN3_1_7B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16)
DRAFTER = dict(block_size=7, num_layers=5, markov_rank=256, head="markov", confidence_head=True,
               confidence_head_with_markov=True)


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` (its outputs ready) over ``repeats`` calls."""
    import jax

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def param_bytes(state) -> int:
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


def decode(args, target, cfg) -> dict:
    """Section 1: tokens/s and HBM roofline fraction of greedy AR decoding."""
    import numpy as np

    import dspark_jax

    rng = np.random.default_rng(0)
    out = {}
    weights = param_bytes(target.state)
    for batch in args.batches:
        prompts = rng.integers(10, cfg["vocab_size"] - 10, (batch, args.prompt_len)).tolist()
        kw = dict(max_new_tokens=args.new_tokens)
        dspark_jax.generate(target, prompts, **kw)  # compile
        start = time.perf_counter()
        results = dspark_jax.generate(target, prompts, **kw)
        seconds = time.perf_counter() - start
        tokens = sum(len(r.token_ids) for r in results)
        steps = results[0].stats["steps"]
        context = args.prompt_len + args.new_tokens / 2  # mean committed length while decoding
        kv_bytes = (batch * context * cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"]
                    * cfg["head_dim"] * target.dtype.itemsize)
        steps_per_s = steps / seconds
        out[f"batch_{batch}"] = dict(
            tokens_per_s=tokens / seconds, steps=steps, seconds=seconds,
            bytes_per_step=weights + kv_bytes,
            hbm_roofline_fraction=(weights + kv_bytes) * steps_per_s / args.hbm_bytes_per_s)
    return out


def verify_costs(target, cfg, rows: int, sizes, context: int, repeats: int,
                 cache_attention: str | None = None) -> dict:
    """ms of one verify forward of T tokens per row, T in ``sizes``, over ``context`` slots,
    the cache attended by ``cache_attention`` (None: the backend's)."""
    import jax.numpy as jnp

    from dspark_jax.models.kv_cache import KVCache

    step = verify_step(target, (), cache_attention)
    slots = -(-(context + max(sizes) + 1) // 128) * 128  # a multiple the decode kernel tiles
    transposed_keys = False if cache_attention == "pallas" else None  # the kernel's layout
    ms = {}
    for t in sizes:
        cache = KVCache.zeros(cfg["num_hidden_layers"], rows, slots, cfg["num_key_value_heads"],
                              cfg["head_dim"], target.dtype, transposed_keys)
        tokens = jnp.ones((rows, t), jnp.int32)
        positions = jnp.broadcast_to(context + jnp.arange(t, dtype=jnp.int32), (rows, t))
        holder = [cache]

        def call():
            logits, _, holder[0] = step(target.state, holder[0], tokens, positions)
            return logits

        call()  # compile
        ms[t] = 1e3 * median_seconds(call, repeats)
    return ms


def sps(args, target, cfg) -> dict:
    """Section 2: the verify cost curve at batch 1, per kernel over the cache; the top-level
    numbers are the first kernel's (the backend's default)."""
    curves = {}
    for impl in args.cache_attention:
        ms = verify_costs(target, cfg, 1, args.sps_sizes, args.prompt_len, args.repeats, impl)
        curves[impl] = dict(ms=ms, decode_steps={t: v / ms[1] for t, v in ms.items()},
                            steps_per_s={t: 1e3 / v for t, v in ms.items()})
    out = dict(context=args.prompt_len, cache_attention=args.cache_attention[0],
               **curves[args.cache_attention[0]], curves=curves)
    if {"pallas", "einsum"} <= set(curves):
        out["pallas_speedup"] = {t: curves["einsum"]["ms"][t] / curves["pallas"]["ms"][t]
                                 for t in args.sps_sizes}
    return out


def speculative(args, target, cfg) -> dict:
    """Section 3: draft and verify step costs, and the speedups they allow."""
    import jax
    import jax.numpy as jnp

    import dspark_jax
    from dspark_jax.prompts import chat_ids

    drafter = dspark_jax.init_drafter(target, seed=0, **DRAFTER)
    block = drafter.config.block_size
    draft = draft_step(target)
    out = {}
    for rows in args.batches:
        ms = verify_costs(target, cfg, rows, (1, block), args.prompt_len, args.repeats)
        cache = drafter.model.init_cache(rows, args.prompt_len + 2 * block)
        taps = jnp.zeros((rows, block, len(drafter.config.target_layer_ids) * cfg["hidden_size"]),
                         target.dtype)
        positions = jnp.broadcast_to(args.prompt_len + jnp.arange(block, dtype=jnp.int32), (rows, block))
        anchor = jnp.ones((rows,), jnp.int32)
        anchor_pos = jnp.full((rows,), args.prompt_len + block, jnp.int32)
        holder = [cache]
        key = jax.random.key(0)

        def call():
            sample, holder[0] = draft(drafter.graphdef, drafter.state, target.state, holder[0], taps,
                                      positions, anchor, anchor_pos, key, jnp.float32(0.0),
                                      jnp.float32(1.0), jnp.int32(0))
            return sample

        call()
        t_draft = 1e3 * median_seconds(call, args.repeats)
        t_decode, t_verify = ms[1], ms[block]
        out[f"batch_{rows}"] = dict(
            decode_ms=t_decode, verify_block_ms=t_verify, draft_ms=t_draft,
            draft_in_decode_steps=t_draft / t_decode, verify_in_decode_steps=t_verify / t_decode,
            speedup_at_tau={tau: tau * t_decode / (t_draft + t_verify)
                            for tau in (2.0, 3.0, 4.0, 5.0)})
    if args.smollm2:
        small = dspark_jax.load_target("smollm2-135m-instruct")
        packaged = dspark_jax.load_drafter("dspark-smollm2-135m-campaign", small)
        prompts = [chat_ids(small.tokenizer, q) for q in (
            "What is 17 times 23? Think step by step.",
            "Write a Python function that checks whether a number is prime.")]
        walls = {}
        for name, kw in (("ar", {}), ("spec", dict(drafter=packaged))):
            dspark_jax.generate(small, prompts, max_new_tokens=args.new_tokens, **kw)
            start = time.perf_counter()
            results = dspark_jax.generate(small, prompts, max_new_tokens=args.new_tokens, **kw)
            walls[name] = (time.perf_counter() - start, sum(len(r.token_ids) for r in results))
        out["smollm2_packaged_dspark"] = dict(
            speedup=(walls["spec"][1] / walls["spec"][0]) / (walls["ar"][1] / walls["ar"][0]))
    else:
        out["smollm2_packaged_dspark"] = ("skipped: the SmolLM2 GGUF (98 MB) cannot travel with the "
                                          "working tree; run with --smollm2 where it is installed")
    return out


def train(args, target, cfg) -> dict:
    """Section 4: the DSpark train step with online features: tokens/s and MFU."""
    import jax
    import ml_collections

    import dspark_jax
    from dspark_jax import experiment, sharding
    from dspark_jax.training import step as train_step

    drafter = dspark_jax.init_drafter(target, seed=0, **DRAFTER)
    tcfg = ml_collections.ConfigDict(dict(experiment.DSPARK_TRAIN))
    tcfg.global_batch_size, tcfg.pack_length = args.train_rows, args.train_length
    tcfg.anchors_per_row = min(512, args.train_length // 4)
    from bench_train_features import synthetic_batch

    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    optimizer = train_step.make_optimizer(tcfg, 1000)
    example = jax.eval_shape(lambda s: train_step.init_train_state(s, optimizer), drafter.state)
    step = train_step.make_train_step(drafter.graphdef, target.graphdef, tcfg, optimizer, mesh=mesh,
                                      state=example, target_state=target.state,
                                      anchor_chunk=tcfg.anchor_chunk, compute_dtype=target.dtype)
    batch = synthetic_batch(target, drafter, tcfg.global_batch_size, tcfg.pack_length,
                            tcfg.anchors_per_row, None)
    state = train_step.init_train_state(drafter.state, optimizer, mesh)
    compiled = step.lower(state, target.state, batch).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops = float((cost or {}).get("flops", 0.0))
    holder = [state]

    def call():
        holder[0], metrics = compiled(holder[0], target.state, batch)
        return metrics

    call()
    seconds = median_seconds(call, args.repeats)
    tokens = args.train_rows * args.train_length
    return dict(rows=args.train_rows, length=args.train_length, anchors_per_row=tcfg.anchors_per_row,
                step_s=seconds, tokens_per_s=tokens / seconds, flops_per_step=flops,
                mfu=flops / seconds / args.peak_flops if flops else None)


def attention(args, target, cfg) -> dict:
    """Section 5: the packed target forward through the einsum and through the fused kernel."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dspark_jax.models import fused_attention

    rows, length = args.train_rows, args.train_length
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg["vocab_size"], (rows, length)), jnp.int32)
    quarter = length // 4
    segments = np.repeat(np.arange(1, 5, dtype=np.int32), quarter)[None].repeat(rows, 0)
    segments[:, length - length // 16:] = 0  # padding at the end of every row
    positions = jnp.asarray(np.broadcast_to(np.arange(length) % quarter, (rows, length)), jnp.int32)
    segments = jnp.asarray(segments)
    fused = fused_attention.default_implementation()
    fused = "xla" if fused == "einsum" else fused
    result, outputs = dict(rows=rows, length=length, fused=fused), {}
    if fused == "cudnn":  # otherwise the "cudnn" route runs the einsum: the row says so
        probe = jax.ShapeDtypeStruct((rows, length, 1, cfg["head_dim"]), target.dtype)
        result["cudnn_applies"] = fused_attention.cudnn_applies(probe, length)
    # (name, implementation, max_segments): the fused kernel given the segments as a mask and,
    # bounded, as lengths (cuDNN's packed layout; splash reads segment ids either way).
    routes = [("einsum", "einsum", None), (fused, fused, None), (fused + "_packed", fused, 4)]
    for name, impl, bound in routes:
        forward = jax.jit(lambda state, impl=impl, bound=bound: nnx.merge(target.graphdef, state)(
            tokens, positions, segment_ids=segments, max_segments=bound, attention=impl).hidden)
        outputs[name] = forward(target.state)
        result[name + "_ms"] = 1e3 * median_seconds(lambda: forward(target.state), args.repeats)
    real = np.asarray(segments) != 0
    for name, _, _ in routes[1:]:
        result[name + "_speedup"] = result["einsum_ms"] / result[name + "_ms"]
        result[name + "_max_abs_diff"] = float(np.max(np.abs(
            np.asarray(outputs[name], np.float32)[real] - np.asarray(outputs["einsum"], np.float32)[real])))
    return result


SECTIONS = {"decode": decode, "sps": sps, "speculative": speculative, "train": train,
            "attention": attention}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "device_suite.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: a CPU dry run")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--sps-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--train-rows", type=int, default=8)
    parser.add_argument("--train-length", type=int, default=2048)
    parser.add_argument("--hbm-bytes-per-s", type=float, default=4.3e12)
    parser.add_argument("--peak-flops", type=float, default=989e12)
    parser.add_argument("--smollm2", action="store_true", help="also the packaged SmolLM2 drafter")
    parser.add_argument("--cache-attention", nargs="+", choices=("einsum", "pallas"),
                        help="the sps section's kernels over the KV cache, the default first "
                             "(default: pallas and einsum on a GPU, einsum elsewhere)")
    args = parser.parse_args()
    if args.smoke:
        args.batches, args.prompt_len, args.new_tokens = [1, 4], 32, 8
        args.sps_sizes, args.repeats, args.train_rows, args.train_length = [1, 2, 8], 2, 2, 64

    import jax
    import jax.numpy as jnp

    from dspark_jax.models.fused_attention import default_cache_implementation
    from dspark_jax.target import init_target

    if not args.cache_attention:  # on a GPU both kernels, the default first
        args.cache_attention = (["pallas", "einsum"] if default_cache_implementation() == "pallas"
                                else ["einsum"])
    cfg = SMOKE if args.smoke else QWEN3_1_7B
    result = dict(command=command_line(__file__), date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                  device=str(jax.devices()[0].device_kind), backend=jax.default_backend(),
                  jax=jax.__version__, host=platform.node(), smoke=args.smoke, target=cfg)
    # bfloat16 on the accelerator; float32 on a CPU (XLA:CPU lacks some bfloat16 dots).
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    result["dtype"] = jnp.dtype(dtype).name
    target = init_target(cfg, dtype=dtype, seed=0)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for name in args.sections:
        started = time.perf_counter()
        try:
            result[name] = SECTIONS[name](args, target, cfg)
        except Exception:  # a failed section is recorded; the others still run
            result[name] = dict(error=traceback.format_exc(limit=8))
        result[name + "_seconds"] = time.perf_counter() - started
        args.output.write_text(json.dumps(result, indent=1, default=str))
        print(f"[device_suite] {name}: {result[name + '_seconds']:.0f} s", flush=True)
    print(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
