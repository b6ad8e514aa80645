"""serve-bench: throughput and proposal length against concurrency, per policy (paper Fig. 8).

For each concurrency C an engine with C slots replays the same prompts closed-loop
(``loadgen.closed_loop``) ``repeats`` times per policy. Policy specs:

* ``full``, ``prefix``, ``production``: the verification policies of the same name; the two
  schedulers read the engine's measured steps/s table (``Engine.profile_sps``, cached),
  profiled with the run's sampling parameters;
* ``fixed<G>`` (e.g. ``fixed1``, the MTP-1 analogue): G drafts per request per step;
* ``threshold<T>`` (e.g. ``threshold0.5``): the reference's static truncation;
* ``fixed-best``: every fixed G in 1..P, reporting the best aggregate throughput at each C.

Reported per (policy, C): aggregate tokens/s (the median of ``repeats`` runs, with their range),
tokens/s per user, mean proposal length (draft tokens verified) per request per step, tau,
mean forward tokens per step.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Callable, Sequence

from dspark_jax.engine import Engine
from dspark_jax.serving.loadgen import closed_loop

SPS_POLICIES = ("prefix", "production")


def parse_policy(spec: str, proposals: int) -> list[tuple[str, dict]]:
    """The (policy, params) runs of one policy spec (several for ``fixed-best``).

    Raises:
      ValueError: an unknown spec or a gamma outside 1..P.
    """
    if spec in ("full",) + SPS_POLICIES:
        return [(spec, {})]
    if spec == "fixed-best":
        return [("fixed", {"gamma": g}) for g in range(1, proposals + 1)]
    match = re.fullmatch(r"fixed(\d+)", spec)
    if match:
        gamma = int(match.group(1))
        if not 1 <= gamma <= proposals:
            raise ValueError(f"{spec}: gamma must be in 1..{proposals}")
        return [("fixed", {"gamma": gamma})]
    match = re.fullmatch(r"threshold([0-9.]+)", spec)
    if match:
        return [("threshold", {"threshold": float(match.group(1))})]
    raise ValueError(f"unknown policy spec {spec!r}: use full, prefix, production, fixed<G>, "
                     "fixed-best or threshold<T>")


def serve_bench(target, drafter, prompts: Sequence[Sequence[int]], *, policies: Sequence[str],
                concurrency: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                top_p: float = 1.0, top_k: int = 0, seed: int = 0, buckets=None,
                repeats: int = 1, sps_repeats: int = 10, sps_warmup: int = 3,
                refresh_sps: bool = False, weight_dtype=None, draft_weight_dtype=None,
                progress: Callable[[str], None] = print) -> dict:
    """Runs every policy at every concurrency on the same prompts.

    Each distinct (policy, parameters) runs ``repeats`` times per concurrency, the repeats going
    round-robin over the policies so that a drift of the machine spreads over all of them (a run
    shared by two specs, e.g. ``fixed1`` and fixed-best's gamma 1, runs once). A row is the run
    with the median aggregate tokens/s (the lower median for even repeats), and
    ``tokens_per_s_runs`` lists every run's. ``weight_dtype`` and ``draft_weight_dtype`` are
    the engines' (:class:`Engine`).

    Returns:
      {"config": ..., "rows": [one dict per (policy spec, C)], "sps": {C: profile JSON}}; a
      fixed-best row carries the chosen ``gamma`` and the whole ``sweep`` (medians).
    """
    if repeats < 1:
        raise ValueError(f"need repeats >= 1, got {repeats}")
    proposals = drafter.num_proposals
    runs = {spec: parse_policy(spec, proposals) for spec in policies}
    variants = list(dict.fromkeys(_variant(policy, params) for spec_runs in runs.values()
                                  for policy, params in spec_runs))
    max_prompt_len = max(len(p) for p in prompts)
    max_len = max_prompt_len + max_new_tokens
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
    rows, profiles = [], {}
    for users in concurrency:
        engine = Engine(target, drafter, slots=users, max_len=max_len, buckets=buckets, seed=seed,
                        weight_dtype=weight_dtype, draft_weight_dtype=draft_weight_dtype)
        table = None
        if any(policy in SPS_POLICIES for policy, _ in variants):
            progress(f"C={users}: profiling steps/s over buckets {list(engine.buckets)}")
            profile = engine.profile_sps(repeats=sps_repeats, warmup=sps_warmup,
                                         refresh=refresh_sps, **sampling)
            profiles[users] = profile.to_json()
            table = profile.table().tolist()
        measured = {variant: [] for variant in variants}
        for repeat in range(repeats):
            for policy, frozen in variants:
                params = dict(frozen)
                if policy in SPS_POLICIES:
                    params["sps"] = table
                engine.set_policy(policy, params)
                compile_s = engine.compile(max_prompt_len)
                result = dataclasses.asdict(closed_loop(engine, prompts, concurrency=users,
                                                        max_new_tokens=max_new_tokens, **sampling))
                result.update(compile_s=compile_s, gamma=params.get("gamma"))
                measured[(policy, frozen)].append(result)
                progress(f"C={users} run {repeat + 1}/{repeats} {policy} "
                         f"{params.get('gamma', params.get('threshold', ''))}: "
                         f"{result['tokens_per_s']:.1f} tok/s, tau {result['tau']:.2f}, "
                         f"proposal_len {result['mean_proposal_len']:.2f}")
        for spec, spec_runs in runs.items():
            results = [median_run(measured[_variant(policy, params)])
                       for policy, params in spec_runs]
            best = dict(max(results, key=lambda r: r["tokens_per_s"]), policy=spec)
            if spec == "fixed-best":
                best["sweep"] = [{k: r[k] for k in ("gamma", "tokens_per_s", "tau")}
                                 for r in results]
            rows.append(best)
        del engine
    config = dict(policies=list(policies), concurrency=list(concurrency), prompts=len(prompts),
                  max_new_tokens=max_new_tokens, max_len=max_len, seed=seed, repeats=repeats,
                  weight_dtype=weight_dtype, draft_weight_dtype=draft_weight_dtype, **sampling)
    return dict(config=config, rows=rows, sps=profiles)


def _variant(policy: str, params: dict) -> tuple:
    """A hashable (policy, parameters) run: specs that share one run it once."""
    return policy, tuple(sorted(params.items()))


def median_run(results: Sequence[dict]) -> dict:
    """The run with the (lower) median aggregate tokens/s, with every run's in
    ``tokens_per_s_runs``."""
    ordered = sorted(results, key=lambda r: r["tokens_per_s"])
    return dict(ordered[(len(ordered) - 1) // 2],
                tokens_per_s_runs=[r["tokens_per_s"] for r in results])


def _spread(runs) -> str:
    return f"{min(runs):.1f}-{max(runs):.1f}" if runs and len(runs) > 1 else "-"


COLUMNS = (("policy", "policy", "{}"), ("C", "concurrency", "{}"),
           ("tokens/s", "tokens_per_s", "{:.1f}"),
           ("runs (tokens/s)", "tokens_per_s_runs", _spread),
           ("tokens/s/user", "tokens_per_s_per_user", "{:.1f}"),
           ("proposal_len/req/step", "mean_proposal_len", "{:.2f}"), ("tau", "tau", "{:.2f}"),
           ("B/step", "mean_verified_tokens", "{:.1f}"), ("gamma", "gamma", "{}"))


def markdown_table(result: dict) -> str:
    lines = ["| " + " | ".join(c[0] for c in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    for row in result["rows"]:
        cells = []
        for _, key, fmt in COLUMNS:
            value = row.get(key)
            if callable(fmt):
                cells.append(fmt(value))
            else:
                cells.append("-" if value is None else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_bench(result: dict, path: str | Path) -> Path:
    """PNG: aggregate tokens/s, tokens/s per user and proposal length per request against
    concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = (("tokens_per_s", "aggregate tokens/s"),
              ("tokens_per_s_per_user", "tokens/s per user"),
              ("mean_proposal_len", "proposal length / request / step"))
    for spec in result["config"]["policies"]:
        rows = sorted((r for r in result["rows"] if r["policy"] == spec),
                      key=lambda r: r["concurrency"])
        for ax, (key, _) in zip(axes, panels):
            ax.plot([r["concurrency"] for r in rows], [r[key] for r in rows], "o-", label=spec)
    for ax, (_, label) in zip(axes, panels):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (users)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(result: dict, output_dir: str | Path) -> dict[str, Path]:
    """serve_bench.json, serve_bench.md and serve_bench.png under ``output_dir``."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = dict(json=out / "serve_bench.json", markdown=out / "serve_bench.md",
                 plot=out / "serve_bench.png")
    paths["json"].write_text(json.dumps(result, indent=1))
    paths["markdown"].write_text(markdown_table(result))
    plot_bench(result, paths["plot"])
    return paths
