"""``dspark-jax demo``: the whole story on the embedded default model in one command.

Loads SmolLM2-135M-Instruct and the longest-trained DSpark drafter shipped with the package
(``dspark-smollm2-135m-campaign``: ``configs/dspark_smollm2_135m.py`` trained on a CPU by
``launch/smollm2_campaign``) and answers a few prompts greedily three ways in the
same engine: autoregressively, speculatively verifying the full block, and speculatively with
the DSpark production scheduler sizing each verify from this machine's steps/s profile
(measured once and cached). It checks that all three emit the same tokens and prints the
answers and, per way, tau (tokens per target forward), mean drafts verified and the wall-clock
speedup over autoregressive decoding. Each prompt is decoded ``repeats`` times in turn (the three
ways alternating) and each way keeps its fastest time: one timing of a few seconds on a shared
CPU moved a way's speedup by a third between runs (BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from tqdm.auto import tqdm

from dspark_jax.drafter import load_drafter
from dspark_jax.engine import machine_sps_table
from dspark_jax.generation import generate
from dspark_jax.prompts import encode_prompts
from dspark_jax.target import load_target

DEFAULT_PROMPTS = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give three tips for staying healthy.",
)
WAYS = ("full", "production")  # the speculative ways, each against autoregressive decoding


@dataclasses.dataclass
class Decoded:
    """One prompt decoded one way (times are compiled decode only: ``generate``'s wall_s, the
    fastest of the demo's repeats)."""

    token_ids: list[int]
    wall_s: float
    rounds: int = 0  # verify rounds (speculative)
    tau: float = 1.0  # tokens per target forward
    verified: float = 0.0  # mean drafts verified per round


@dataclasses.dataclass
class DemoRow:
    prompt: str
    answer: str
    ar: Decoded
    spec: dict[str, Decoded]  # way -> decoded (the first repeat's tokens)
    unstable: list[str] = dataclasses.field(default_factory=list)  # ways whose tokens changed

    def identical(self, way: str) -> bool:
        """The way's tokens equal the autoregressive ones, and neither changed between repeats."""
        return (self.spec[way].token_ids == self.ar.token_ids
                and not {way, "autoregressive"} & set(self.unstable))


def _decoded(result) -> Decoded:
    s = result.stats
    if "tau" not in s:
        return Decoded(result.token_ids, s["wall_s"])
    return Decoded(result.token_ids, s["wall_s"], s["rounds"], s["tau"], s["proposal_len"])


def run_demo(model: str = "smollm2-135m-instruct", drafter: str = "dspark-smollm2-135m-campaign",
             prompts: Sequence[str] = DEFAULT_PROMPTS, *, max_new_tokens: int = 128,
             repeats: int = 2, sps=None, weight_dtype=None, draft_weight_dtype="bfloat16",
             progress: bool = True) -> list[DemoRow]:
    """Greedy autoregressive, full-block and production-scheduled decoding of each prompt
    alone (batch 1).

    Args:
      repeats: decodes of each prompt per way, the ways alternating; each way keeps its fastest
        time, and a way whose tokens change between repeats is reported by :func:`mismatches`.
      sps: the production scheduler's steps/s table by forward tokens; default this machine's
        profile for one request (``engine.machine_sps_table``, cached after the first run).
      weight_dtype: the target's weight matrices in this dtype in every way (``generate``'s),
        e.g. bfloat16 on a CPU with AMX; greedy outputs may then part at a near-tie (README),
        which :func:`mismatches` reports.
      draft_weight_dtype: the drafter's weight matrices in this dtype (``generate``'s; default
        bfloat16: a faster draft step where bfloat16 matmuls are fast, the same tokens; None or
        "float32": as loaded).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    target = load_target(model)
    draft = load_drafter(drafter, target)
    if sps is None:
        longest = max(len(ids) for ids in encode_prompts(target, prompts))
        sps = machine_sps_table(target, draft, slots=1, prompt_len=longest,
                                max_new_tokens=max_new_tokens, weight_dtype=weight_dtype,
                                draft_weight_dtype=draft_weight_dtype)

    def decode(way):
        common = dict(max_new_tokens=max_new_tokens, weight_dtype=weight_dtype)
        if way == "autoregressive":
            return generate(target, [prompt], **common)[0]
        return generate(target, [prompt], drafter=draft, verify=way,
                        verify_params={"sps": sps} if way == "production" else None,
                        draft_weight_dtype=draft_weight_dtype, **common)[0]

    rows = []
    for prompt in tqdm(prompts, desc="demo", unit="prompt", disable=not progress):
        first, fastest, unstable = {}, {}, []
        for _ in range(repeats):
            for way in ("autoregressive",) + WAYS:
                result = decode(way)
                decoded = _decoded(result)
                first.setdefault(way, (result.text, decoded))
                if decoded.token_ids != first[way][1].token_ids and way not in unstable:
                    unstable.append(way)
                fastest[way] = min(fastest.get(way, decoded.wall_s), decoded.wall_s)
        kept = {way: dataclasses.replace(d, wall_s=fastest[way]) for way, (_, d) in first.items()}
        rows.append(DemoRow(prompt, first["autoregressive"][0], kept["autoregressive"],
                            {way: kept[way] for way in WAYS}, unstable))
    return rows


def format_report(rows: Sequence[DemoRow]) -> str:
    """The answers, then per prompt and overall: new tokens, autoregressive seconds, and for
    each speculative way tau, mean drafts verified, seconds, speedup and token equality."""
    lines = []
    for i, row in enumerate(rows, 1):
        lines += [f"[{i}] {row.prompt}", f"--> {row.answer.strip()}", ""]
    header = "| prompt | new tokens | autoregressive (s) |"
    rule = "|---|---|---|"
    for way in WAYS:
        header += f" {way}: tau | verified | s | speedup | same |"
        rule += "---|---|---|---|---|"
    lines += [header, rule]

    def cells(label, ar_s, tokens, decoded: dict[str, list[Decoded]], same: dict[str, bool]):
        line = f"| {label} | {tokens} | {ar_s:.2f} |"
        for way in WAYS:
            runs = decoded[way]
            rounds = max(sum(d.rounds for d in runs), 1)
            tau = sum(d.tau * d.rounds for d in runs) / rounds
            verified = sum(d.verified * d.rounds for d in runs) / rounds
            wall = sum(d.wall_s for d in runs)
            line += (f" {tau:.2f} | {verified:.2f} | {wall:.2f} | {ar_s / wall:.2f}x | "
                     f"{same[way]} |")
        return line

    for i, row in enumerate(rows, 1):
        lines.append(cells(i, row.ar.wall_s, len(row.ar.token_ids),
                           {w: [row.spec[w]] for w in WAYS}, {w: row.identical(w) for w in WAYS}))
    lines.append(cells("all", sum(r.ar.wall_s for r in rows),
                       sum(len(r.ar.token_ids) for r in rows),
                       {w: [r.spec[w] for r in rows] for w in WAYS},
                       {w: all(r.identical(w) for r in rows) for w in WAYS}))
    return "\n".join(lines)


def mismatches(rows: Sequence[DemoRow]) -> list[str]:
    """One line per (prompt, way) whose speculative tokens differ from autoregressive ones, or
    whose tokens changed between the demo's repeats."""
    out = []
    for i, row in enumerate(rows, 1):
        out += [f"prompt {i}, {way}: the tokens changed between the demo's repeats"
                for way in row.unstable]
        for way in WAYS:
            spec = row.spec[way].token_ids
            if spec != row.ar.token_ids:
                at = next((j for j, (a, b) in enumerate(zip(row.ar.token_ids, spec)) if a != b),
                          min(len(spec), len(row.ar.token_ids)))
                out.append(f"prompt {i}, {way}: speculative tokens differ from autoregressive "
                           f"ones from token {at} on ({len(spec)} vs {len(row.ar.token_ids)} "
                           "tokens)")
    return out
