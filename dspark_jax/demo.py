"""``dspark-jax demo``: the whole story on the embedded default model in one command.

Loads SmolLM2-135M-Instruct and the DSpark drafter shipped with the package (trained on a CPU
with ``configs/dspark_smollm2_135m.py``), answers a few prompts greedily with autoregressive
and with speculative decoding in the same engine, checks that both emit the same tokens, and
prints the answers, tau (tokens per target forward) and the wall-clock speedup.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from tqdm.auto import tqdm

from dspark_jax.drafter import load_drafter
from dspark_jax.generation import generate
from dspark_jax.target import load_target

DEFAULT_PROMPTS = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give three tips for staying healthy.",
)


@dataclasses.dataclass
class DemoRow:
    prompt: str
    answer: str
    new_tokens: int
    tau: float  # tokens per verification round (stats "tau")
    rounds: int
    ar_s: float  # autoregressive wall time (compiled)
    spec_s: float  # speculative wall time (compiled)
    identical: bool  # speculative tokens == autoregressive tokens


def run_demo(model: str = "smollm2-135m-instruct", drafter: str = "dspark-smollm2-135m",
             prompts: Sequence[str] = DEFAULT_PROMPTS, *, max_new_tokens: int = 128,
             verify: str = "full", progress: bool = True) -> list[DemoRow]:
    """Greedy autoregressive vs speculative decoding of each prompt alone (batch 1).

    Times are the engine's ``wall_s``: the compiled decode only (``generate`` compiles ahead of
    time and reports that separately).
    """
    target = load_target(model)
    draft = load_drafter(drafter, target)
    rows = []
    for prompt in tqdm(prompts, desc="demo", unit="prompt", disable=not progress):
        ar = generate(target, [prompt], max_new_tokens=max_new_tokens)[0]
        spec = generate(target, [prompt], max_new_tokens=max_new_tokens, drafter=draft,
                        verify=verify)[0]
        rows.append(DemoRow(prompt, spec.text, len(spec.token_ids), spec.stats["tau"],
                            spec.stats["rounds"], ar.stats["wall_s"], spec.stats["wall_s"],
                            ar.token_ids == spec.token_ids))
    return rows


def format_report(rows: Sequence[DemoRow]) -> str:
    """The answers, then a table of tau and speedup per prompt and overall."""
    lines = []
    for i, row in enumerate(rows, 1):
        lines += [f"[{i}] {row.prompt}", f"--> {row.answer.strip()}", ""]
    lines.append("| prompt | new tokens | tau | autoregressive (s) | speculative (s) | speedup | "
                 "same tokens |")
    lines.append("|---|---|---|---|---|---|---|")
    for i, row in enumerate(rows, 1):
        lines.append(f"| {i} | {row.new_tokens} | {row.tau:.2f} | {row.ar_s:.2f} | "
                     f"{row.spec_s:.2f} | {row.ar_s / row.spec_s:.2f}x | {row.identical} |")
    tokens = sum(r.new_tokens for r in rows)
    ar, spec = sum(r.ar_s for r in rows), sum(r.spec_s for r in rows)
    tau = sum(r.tau * r.rounds for r in rows) / max(sum(r.rounds for r in rows), 1)
    lines.append(f"| all | {tokens} | {tau:.2f} | {ar:.2f} | {spec:.2f} | {ar / spec:.2f}x | "
                 f"{all(r.identical for r in rows)} |")
    return "\n".join(lines)
