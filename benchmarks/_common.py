"""Pieces the benchmark scripts share: the command line, the machine's name, a wall-clock
timer, its memory
read bandwidth, XLA:CPU's per-operation profile table, and the jitted prefill, target-verify and
draft steps they time in isolation.

The scripts run as ``python benchmarks/<name>.py``, so this folder is on ``sys.path``.
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def command_line(script: str, argv: list[str] | None = None) -> str:
    """The command that runs ``script`` (a benchmark's ``__file__``) with ``argv`` (default
    ``sys.argv[1:]``), as BENCHMARKS.md gives it: ``python benchmarks/<name>.py <arguments>``."""
    path = Path(script).resolve()
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return " ".join(["python", str(name), *(sys.argv[1:] if argv is None else argv)])


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (else what ``platform`` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def timed(fn) -> float:
    """Seconds one call of ``fn()`` takes until its outputs are ready."""
    import jax

    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def alternating_samples(calls: dict, repeats: int) -> dict[object, list[float]]:
    """Seconds of each of ``calls`` (key -> a function of no arguments), timed in ``repeats``
    rounds that call every function once, in an order that reverses every round (so drifts
    of the machine's speed fall on all of them alike)."""
    samples = {key: [] for key in calls}
    order = list(calls)
    for i in range(repeats):
        for key in (order if i % 2 == 0 else order[::-1]):
            samples[key].append(timed(calls[key]))
    return samples


def read_bandwidth() -> float:
    """Bytes per second of a jitted sum over 1 GiB of float32 (best of 5)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((256 * 1024 * 1024,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        total(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return x.nbytes / best


def write_report(report: dict, output: Path) -> None:
    """Writes a benchmark's report as indented JSON to ``output`` (its folder made) and says so,
    with the load average at the end recorded as ``load_after``."""
    report["load_after"] = os.getloadavg()[0]
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {output}")


def op_table(trace_dir: Path, hlo: str, per: int, *, group: bool, top: int) -> list[str]:
    """The most expensive operations of a ``jax.profiler`` trace (XLA:CPU with
    ``--xla_cpu_enable_xprof_traceme=true``), as lines 'ms per unit, calls per unit, program:
    name, output shape', divided by ``per`` (steps); ``group`` adds up operations of one
    program that differ only in their numeric suffix; shapes come from the compiled ``hlo``
    text (one or more modules). Programs name operations alike (``ynn_fusion.1`` of the
    admission is another matmul than the rounds'), so each operation is keyed by its program."""
    shapes, module = {}, ""
    for line in hlo.splitlines():
        if line.startswith("HloModule "):
            module = line.split()[1].rstrip(",")
        elif found := re.search(r"%(\S+) = (\S+) ", line):
            shapes[(module, found[1])] = found[2]
    path = sorted(trace_dir.glob("**/*.trace.json.gz"), key=os.path.getmtime)[-1]
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    total, count, shape = collections.Counter(), collections.Counter(), {}
    for event in events:
        if event.get("ph") != "X" or event["name"].startswith(("$", "end:", "ThunkExecutor")):
            continue
        module = event.get("args", {}).get("hlo_module", "")
        name = re.sub(r"\.\d+$", "", event["name"]) if group else event["name"]
        key = (module, name)
        total[key] += event.get("dur", 0)
        count[key] += 1
        shape.setdefault(key, shapes.get((module, event["name"]), ""))
    return [f"{micros / per / 1e3:9.2f}  {count[key] / per:6.1f}x  "
            f"{(key[0].removeprefix('jit_') + ':' if key[0] else '') + key[1]:48s} {shape[key]}"
            for key, micros in total.most_common(top)]


def verify_step(target, tap_layer_ids: tuple[int, ...], cache_attention: str | None = None):
    """Jitted ``(target_state, cache, tokens [b, T], positions [b, T]) -> (logits, taps,
    cache)``: one target forward through its KV cache (donated), attended by
    ``cache_attention`` (``fused_attention.attend_cache``; None: the backend's)."""
    import jax
    from flax import nnx

    def verify(state, cache, tokens, positions):
        model = nnx.merge(target.graphdef, state)
        out = model(tokens, positions, cache=cache, tap_layer_ids=tap_layer_ids,
                    cache_attention=cache_attention)
        return model.logits(out.hidden), out.taps, out.cache

    return jax.jit(verify, donate_argnums=(1,))


def grid_prefill(model, tokens, cache_dtype, transposed_keys: bool,
                 tap_layer_ids: tuple[int, ...] = (), attention: str | None = None):
    """The engine's admission forward (``decoding/round.py``) of a dense grid of prompts: tokens
    int [b, W] through ``ragged_forward`` over an empty history (``attention``: the prefill
    kernel, None for the backend's). Returns its ``RaggedOutput`` (hidden [b * W, d], taps,
    new_k / new_v [L, b, W, K, D])."""
    import jax.numpy as jnp

    from dspark_jax.models.kv_cache import KVCache
    from dspark_jax.models.ragged import ragged_forward

    rows, width = tokens.shape
    cols = jnp.tile(jnp.arange(width), rows)
    row_of = jnp.repeat(jnp.arange(rows), width)
    empty = KVCache.for_model(model.config, rows, 0, cache_dtype, transposed_keys)
    return ragged_forward(model, tokens.reshape(-1), cols, row_of, cols, jnp.zeros(rows, jnp.int32),
                          empty, width=width, dense=True, tap_layer_ids=tap_layer_ids,
                          attention=attention)


def prefill_step(target, tap_layer_ids: tuple[int, ...]):
    """Jitted ``(target_state, cache, tokens [b, W], lens [b]) -> (last logits [b, V], taps,
    cache)``: the engine's admission: :func:`grid_prefill`, its keys and values written into
    the first W slots of the cache's rows, the LM head at each row's last prompt token."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    def prefill(state, cache, tokens, lens):
        model = nnx.merge(target.graphdef, state)
        rows, width = tokens.shape
        out = grid_prefill(model, tokens, cache.dtype, cache.transposed_keys, tap_layer_ids)
        cache = cache.write_prefix(out.new_k, out.new_v, jnp.arange(rows))
        last = out.hidden.reshape(rows, width, -1)[jnp.arange(rows), lens - 1]
        return model.logits(last), out.taps, cache

    return jax.jit(prefill, donate_argnums=(1,))


def draft_step(target):
    """Jitted ``(drafter_graphdef, drafter_state, target_state, draft_cache, ctx_taps,
    ctx_positions, anchor, anchor_pos, key, temperature, top_p, top_k, draft_vocab=None) ->
    (BlockSample, draft_cache)``: the whole draft step of the engine (context into the draft
    cache, the block's forward, the scan sampler; ``draft_vocab`` a ``block_sampler.DraftVocab``
    or None); the graphdef is static, the cache donated."""
    import jax
    from flax import nnx

    from dspark_jax.decoding.block_sampler import sample_draft

    def draft(graphdef, state, target_state, cache, ctx_taps, ctx_positions, anchor, anchor_pos,
              key, temperature, top_p, top_k, draft_vocab=None):
        model = nnx.merge(graphdef, state)
        target_model = nnx.merge(target.graphdef, target_state)
        out = model.draft(target_model, ctx_taps=ctx_taps, ctx_positions=ctx_positions,
                          cache=cache, anchor_tokens=anchor, anchor_positions=anchor_pos)
        sample = sample_draft(model, target_model, hidden=out.hidden, anchor_tokens=anchor,
                              key=key, temperature=temperature, top_p=top_p, top_k=top_k,
                              draft_vocab=draft_vocab)
        return sample, out.cache

    return jax.jit(draft, static_argnums=(0,), donate_argnums=(3,))
