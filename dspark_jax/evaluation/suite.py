"""The acceptance benchmark (``dspark-jax eval``): tau and acceptance per benchmark and domain.

Benchmarks are the reference's nine prompt sets in the ``{"turns": [...]}`` JSONL form (first
turn only, chat template with thinking disabled), capped as the reference does (a set larger
than its cap is shuffled with seed 980406 and cut; DSPARK_SPEC.md section 7), then optionally
limited to its first ``limit`` prompts. Every drafter decodes the same prompts with full-block
verification, recording the per-round trace for the confidence metrics.

Output folder layout (resumable: a finished benchmark is not run again while its settings and
the sha256 of the drafter's and the target's parameters match; ``evaluate``)::

    <output>/<label>/<bench>.json     statistics of one drafter on one benchmark, and the
                                      settings (decoding, limit, model identities) they came from
    <output>/<label>/<bench>.npz      its AcceptanceTrace (request ids = prompt index)
    <output>/report.json, report.md   every drafter side by side (paper Table 1 layout)
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Mapping, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from dspark_jax.drafter import Drafter
from dspark_jax.evaluation.trace import AcceptanceTrace
from dspark_jax.engine.stats import stats_from_counters, sum_counters
from dspark_jax.generation import generate
from dspark_jax.prompts import (BENCHMARKS, DOMAINS, EVAL_SEED, encode_prompts, load_benchmark,
                                prompt_bucket)
from dspark_jax.target import Target

# The recorded settings that name the models a result came from ({role}_sha256 of params_sha256).
IDENTITY_KEYS = {"drafter": "drafter_sha256", "target": "target_sha256"}
# Recorded only for a drafter with a draft vocabulary: "<V'>:<sha256 of its ids, 12 digits>".
DRAFT_VOCAB_KEY = "draft_vocab"


def plan_batches(lengths: Sequence[int], batch_size: int,
                 max_batch_tokens: int | None = None) -> list[list[int]]:
    """Groups prompt indices into decode batches.

    Without a token budget: consecutive runs of ``batch_size`` prompts, in order. With one:
    prompts sorted by length (stable) and packed greedily, at most ``batch_size`` rows and
    rows x ``prompt_bucket(longest)`` padded prompt tokens <= ``max_batch_tokens`` per batch (a
    prompt longer than the budget gets a batch of its own). A few long prompts then no longer
    pad a whole batch to their length: the prefill cost follows the real tokens.

    Returns:
      The batches as lists of prompt indices, in decode order.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_batch_tokens is None:
        return [list(range(s, min(s + batch_size, len(lengths))))
                for s in range(0, len(lengths), batch_size)]
    if max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
    batches, current = [], []
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        width = prompt_bucket(lengths[index])  # the longest so far: sorted ascending
        if current and (len(current) == batch_size
                        or (len(current) + 1) * width > max_batch_tokens):
            batches.append(current)
            current = []
        current.append(index)
    return batches + [current] if current else batches


def params_sha256(state) -> str:
    """The sha256 (hex) of a model's parameters: every leaf's name, dtype, shape and bytes.

    Leaves are taken in the order of their sorted names (``jax.tree_util.keystr`` of their path
    in ``state``), one at a time on the host, so the digest is deterministic and the host holds
    one leaf at a time. Equal digests mean the same parameters in the same dtype.
    """
    leaves = {jax.tree_util.keystr(path): leaf
              for path, leaf in jax.tree_util.tree_leaves_with_path(state)}
    digest = hashlib.sha256()
    for name in sorted(leaves):
        value = np.asarray(jax.device_get(leaves[name]))
        digest.update(f"{name}|{value.dtype}|{value.shape}\n".encode())
        digest.update(np.ascontiguousarray(value).reshape(-1).view(np.uint8))
    return digest.hexdigest()


def changed_models(recorded: Mapping, identity: Mapping[str, str]) -> str | None:
    """Why a result's recorded settings are not those of the models of ``identity`` (None: same).

    Args:
      recorded: the settings of a finished ``<bench>.json``.
      identity: {``IDENTITY_KEYS`` value: ``params_sha256``} of the current drafter and target.
    """
    if not any(key in recorded for key in IDENTITY_KEYS.values()):
        return "it records no drafter/target identity (written before results were keyed by it)"
    changed = [f"the {role} changed (parameters sha256 {str(recorded.get(key))[:12]} -> "
               f"{identity[key][:12]})" for role, key in IDENTITY_KEYS.items()
               if recorded.get(key) != identity[key]]
    if recorded.get(DRAFT_VOCAB_KEY) != identity.get(DRAFT_VOCAB_KEY):
        changed.append(f"the draft vocabulary changed ({recorded.get(DRAFT_VOCAB_KEY) or 'none'} "
                       f"-> {identity.get(DRAFT_VOCAB_KEY) or 'none'})")
    return " and ".join(changed) or None


def run_benchmark(target: Target, drafter: Drafter, prompts: Sequence[str], *,
                  max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                  top_k: int = 0, batch_size: int = 8, max_batch_tokens: int | None = None,
                  seed: int = EVAL_SEED, desc: str = "eval",
                  progress: bool = True) -> tuple[dict, AcceptanceTrace]:
    """Decodes ``prompts`` in batches (``plan_batches``) with full-block verification.

    Batch ``b`` is seeded with ``seed`` + the number of prompts decoded before it.

    Returns:
      (statistics: ``generation.stats_from_counters`` of all requests plus num_prompts,
      new_tokens, wall_s, tokens_per_s; the AcceptanceTrace of every round, request id =
      index of the prompt in ``prompts``).
    """
    if not prompts:
        raise ValueError("no prompts to evaluate")
    encoded = encode_prompts(target, list(prompts))
    counters, logits, accepted, requests = [], [], [], []
    new_tokens, wall, done = 0, 0.0, 0
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not progress)
    for batch in plan_batches([len(ids) for ids in encoded], batch_size, max_batch_tokens):
        results = generate(target, [encoded[i] for i in batch], max_new_tokens=max_new_tokens,
                           temperature=temperature, top_p=top_p, top_k=top_k, seed=seed + done,
                           drafter=drafter, verify="full", record=True)
        wall += results[0].stats["wall_s"]
        for index, result in zip(batch, results):
            counters.append(result.stats["counters"])
            new_tokens += result.stats["new_tokens"]
            logits.append(result.trace["confidence_logits"])
            accepted.append(result.trace["num_accepted"])
            requests.append(np.full(len(result.trace["num_accepted"]), index))
        done += len(batch)
        bar.update(len(batch))
    bar.close()
    stats = stats_from_counters(sum_counters(counters))
    stats.update(num_prompts=len(prompts), new_tokens=new_tokens, wall_s=wall,
                 tokens_per_s=new_tokens / wall if wall else None)
    trace = AcceptanceTrace.create(np.concatenate(logits), np.concatenate(accepted),
                                   np.concatenate(requests))
    return stats, trace


def evaluate(target: Target, drafters: Mapping[str, Drafter], benches: Sequence[str],
             output_dir: str | Path, *, data_dir: str | Path | None = None,
             limit: int | None = None, progress: bool = True, **decode) -> dict:
    """Runs every drafter on every benchmark (resumable) and writes the side-by-side report.

    A finished ``<label>/<bench>.json`` is reused when its recorded settings equal this call's:
    the decode settings, ``limit`` and the ``params_sha256`` of the drafter and of the target
    (computed once per model). Otherwise the benchmark runs again and overwrites it; when the
    drafter or the target is not the one that produced it (or the file predates the identities),
    a message naming the label, the benchmark and the model that changed is printed first. A
    retrained drafter under an old label is therefore never reported with the old numbers.

    Args:
      drafters: {label: drafter}; the label names the output subfolder and the table row.
      benches: names from ``BENCHMARKS``.
      limit: first N prompts of each benchmark after the cap (None: all).
      **decode: ``run_benchmark`` settings (max_new_tokens, temperature, batch_size,
        max_batch_tokens, ...).

    Returns:
      The report of ``write_report``.
    """
    output = Path(output_dir)
    decode_settings = dict(decode, limit=limit)
    if decode_settings.get("max_batch_tokens") is None:
        decode_settings.pop("max_batch_tokens", None)  # results from before the option match
    target_sha256 = params_sha256(target.state)
    for label, drafter in drafters.items():
        folder = output / label
        folder.mkdir(parents=True, exist_ok=True)
        identity = {IDENTITY_KEYS["drafter"]: params_sha256(drafter.state),
                    IDENTITY_KEYS["target"]: target_sha256}
        if drafter.draft_vocab is not None:
            ids = np.asarray(drafter.draft_vocab, np.int32)
            identity[DRAFT_VOCAB_KEY] = f"{ids.size}:{hashlib.sha256(ids.tobytes()).hexdigest()[:12]}"
        settings = dict(decode_settings, **identity)  # a finished benchmark with these is reused
        for bench in benches:
            path = folder / f"{bench}.json"
            if path.exists():
                recorded = json.loads(path.read_text())["settings"]
                if recorded == settings:
                    continue
                reason = changed_models(recorded, identity)
                if reason is not None:
                    print(f"eval {label!r} on {bench!r}: not reusing {path}: {reason}; "
                          "running it again (the result is overwritten)", flush=True)
            prompts = load_benchmark(bench, data_dir, limit)
            started = time.perf_counter()
            stats, trace = run_benchmark(target, drafter, prompts, desc=f"{label} {bench}",
                                         progress=progress, **decode)
            stats["elapsed_s"] = time.perf_counter() - started
            trace.save(folder / f"{bench}.npz")
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(dict(settings=settings, stats=stats), indent=2))
            tmp.replace(path)
    return write_report(output, list(drafters), benches)


def write_report(output_dir: str | Path, labels: Sequence[str], benches: Sequence[str]) -> dict:
    """Collects the finished ``<label>/<bench>.json`` results into report.json / report.md.

    Benchmarks may have been run by separate ``evaluate`` calls with different settings (e.g. a
    token budget for the long-prompt sets); each run's settings are kept in the report.

    Returns:
      {"settings": {"benches", "runs": {label: {bench: settings}}},
       "results": {label: {bench: statistics}}}.

    Raises:
      ValueError: a benchmark has no finished result.
    """
    output = Path(output_dir)
    results, runs = {}, {}
    for label in labels:
        results[label], runs[label] = {}, {}
        for bench in benches:
            path = output / label / f"{bench}.json"
            if not path.is_file():
                raise ValueError(f"{path}: no finished result for {label!r} on {bench!r}")
            done = json.loads(path.read_text())
            results[label][bench], runs[label][bench] = done["stats"], done["settings"]
    report = dict(settings=dict(benches=list(benches), runs=runs), results=results)
    (output / "report.json").write_text(json.dumps(report, indent=2))
    (output / "report.md").write_text(markdown_table(report))
    return report


def domain_means(stats: Mapping[str, dict], key: str = "tau") -> dict[str, float]:
    """Macro averages of ``key`` over the benchmarks of each domain present, and over all."""
    out = {}
    for domain in DOMAINS:
        values = [s[key] for b, s in stats.items() if BENCHMARKS[b][0] == domain]
        if values:
            out[domain] = float(np.mean(values))
    out["all"] = float(np.mean([s[key] for s in stats.values()]))
    return out


def markdown_table(report: dict) -> str:
    """tau per benchmark and macro averages per domain, one row per drafter, then each
    drafter's conditional acceptance per position (all benchmarks pooled)."""
    results = report["results"]
    benches = report["settings"]["benches"]
    domains = [d for d in DOMAINS if any(BENCHMARKS[b][0] == d for b in benches)] + ["all"]
    lines = ["| drafter | " + " | ".join(benches) + " | " + " | ".join(
        f"mean {d}" for d in domains) + " |", "|---" * (1 + len(benches) + len(domains)) + "|"]
    for label, stats in results.items():
        means = domain_means(stats)
        lines.append(f"| {label} | " + " | ".join(f"{stats[b]['tau']:.2f}" for b in benches)
                     + " | " + " | ".join(f"{means[d]:.2f}" for d in domains) + " |")
    lines += ["", "Pooled over the benchmarks: proposal length, verify rate, tokens/s and the "
              "conditional acceptance at positions 1..P.", "",
              "| drafter | proposal len | verify rate | tokens/s | conditional acceptance |",
              "|---|---|---|---|---|"]
    for label, stats in results.items():
        pooled = stats_from_counters(sum_counters([s["counters"] for s in stats.values()]))
        tokens = sum(s["new_tokens"] for s in stats.values())
        wall = sum(s["wall_s"] for s in stats.values())
        cond = ", ".join("-" if c is None else f"{c:.2f}"
                         for c in pooled["conditional_acceptance"])
        lines.append(f"| {label} | {pooled['proposal_len']:.2f} | {pooled['verify_rate']:.3f} | "
                     f"{tokens / wall:.1f} | {cond} |")
    return "\n".join(lines) + "\n"
