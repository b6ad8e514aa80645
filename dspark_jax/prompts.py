"""Prompts in: benchmark prompt sets, the chat template, token ids and padded widths.

Benchmarks are the reference's nine prompt sets in the ``{"turns": [...]}`` JSONL form (first
turn only), capped as the reference does (a set larger than its cap is shuffled with seed
980406 and cut; DSPARK_SPEC.md section 7). Strings get the tokenizer's chat template (thinking
disabled where the template has the switch); lists of ints are used as they are. Prompts are
right-padded to a power-of-two width so that XLA compiles a bounded number of programs.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Sequence

import numpy as np

from dspark_jax.jsonl import read_jsonl
from dspark_jax.target import Target

EVAL_SEED = 980406
# name: (domain, cap) from the reference evaluation.
BENCHMARKS = {
    "gsm8k": ("math", 500), "math500": ("math", 500), "aime25": ("math", 30),
    "humaneval": ("code", 164), "mbpp": ("code", 256), "livecodebench": ("code", 500),
    "mt-bench": ("chat", 80), "alpaca": ("chat", 500), "arena-hard-v2": ("chat", 500),
}
DOMAINS = ("math", "code", "chat")
MIN_PROMPT_BUCKET = 16
LONG_PROMPT_STEP = 1024


def default_data_dir() -> Path | None:
    """``../shared/data/eval`` beside the working directory or the source checkout, if any."""
    for root in (Path.cwd(), Path(__file__).resolve().parents[1]):
        folder = root.parent / "shared" / "data" / "eval"
        if folder.is_dir():
            return folder
    return None


def load_benchmark(name: str, data_dir: str | Path | None = None,
                   limit: int | None = None) -> list[str]:
    """The first-turn prompts of a benchmark after the reference's cap and seeded shuffle.

    Raises:
      ValueError: unknown benchmark, missing file or no data folder.
    """
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}")
    folder = Path(data_dir) if data_dir is not None else default_data_dir()
    if folder is None:
        raise ValueError("no evaluation data folder: pass --data-dir (the folder of "
                         "gsm8k.jsonl, humaneval.jsonl, ...)")
    path = folder / f"{name}.jsonl"
    if not path.is_file():
        raise ValueError(f"benchmark file {path} not found")
    prompts = []
    for where, record in read_jsonl(path):
        turns = record.get("turns")
        if not turns or not isinstance(turns[0], str):
            raise ValueError(f"{where}: expected a non-empty 'turns' list of strings")
        prompts.append(turns[0])
    cap = BENCHMARKS[name][1]
    if len(prompts) > cap:
        random.Random(EVAL_SEED).shuffle(prompts)
        prompts = prompts[:cap]
    return prompts[:limit] if limit is not None else prompts


def prompt_bucket(length: int) -> int:
    """Padded prompt width: the smallest power of two >= length (and >= MIN_PROMPT_BUCKET) up
    to LONG_PROMPT_STEP, then the smallest multiple of LONG_PROMPT_STEP (a 4,100-token prompt
    pads to 5,120, not 8,192; every width over 512 is a multiple of the attention query chunk)."""
    if length > LONG_PROMPT_STEP:
        return -(-length // LONG_PROMPT_STEP) * LONG_PROMPT_STEP
    return max(MIN_PROMPT_BUCKET, 1 << (max(length, 1) - 1).bit_length())


def encode_prompts(target: Target, prompts: Sequence[str | Sequence[int]]) -> list[list[int]]:
    """Token ids of each prompt; strings go through the chat template."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        raise TypeError("prompts must be a list of strings or a list of token-id lists")
    if not prompts:
        raise ValueError("no prompts given")
    encoded = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError(f"prompt {i} is empty")
            if target.tokenizer is None:
                raise ValueError("this target has no tokenizer: pass token-id lists instead of strings")
            ids = chat_ids(target.tokenizer, prompt)
        else:
            ids = [int(t) for t in prompt]
            if not ids:
                raise ValueError(f"prompt {i} is empty")
        target.check_token_ids(np.asarray(ids))
        encoded.append(ids)
    return encoded


def chat_ids(tokenizer, text: str) -> list[int]:
    """The chat-templated token ids of one user turn, with the generation prompt."""
    return messages_ids(tokenizer, [{"role": "user", "content": text}])


def messages_ids(tokenizer, messages: Sequence[dict]) -> list[int]:
    """The chat-templated token ids of a conversation ({"role", "content": str} dicts), with the
    generation prompt (thinking disabled where the template has the switch). A tokenizer
    without a template gets the contents joined by blank lines."""
    if tokenizer.chat_template:
        rendered = tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                 add_generation_prompt=True, enable_thinking=False)
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return list(tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"])
