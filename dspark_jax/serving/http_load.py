"""``serve-bench --url``: closed-loop load on a running server over HTTP (standard library only).

C users each send their next prompt as a streaming chat completion as soon as their previous
one finished, until the prompts run out, with a time limit on each request and on the run.
Every request is accounted for: completed (``data: [DONE]`` after a finish reason) or failed
(with its HTTP status or error). Reported per concurrency: aggregate tokens/s (completion
tokens from the server's usage over the wall time), latency and time to first token (p50, p99),
and the counts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import threading
import time
import urllib.error
import urllib.request
from typing import Sequence


@dataclasses.dataclass
class RequestRecord:
    ok: bool
    latency_s: float
    ttft_s: float | None = None  # time to the first content chunk
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]  # nearest rank


def chat_stream(url: str, model: str, prompt: str, *, max_tokens: int, temperature: float,
                top_p: float, timeout_s: float) -> RequestRecord:
    """One streaming chat completion; never raises (failures are recorded)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    request = urllib.request.Request(f"{url.rstrip('/')}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"}, method="POST")
    start = time.perf_counter()
    record = RequestRecord(ok=False, latency_s=0.0)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            done = False
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = chunk["error"].get("message")
                    break
                if chunk.get("usage"):
                    record.completion_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    if choice.get("delta", {}).get("content") and record.ttft_s is None:
                        record.ttft_s = time.perf_counter() - start
                    record.finish_reason = choice.get("finish_reason") or record.finish_reason
            record.ok = done and record.finish_reason is not None
            if not record.ok and record.error is None:
                record.error = "the stream ended without a finish reason and [DONE]"
    except urllib.error.HTTPError as error:
        record.error = f"HTTP {error.code}: {error.read().decode(errors='replace')[:200]}"
    except (OSError, ValueError) as error:
        record.error = f"{type(error).__name__}: {error}"
    record.latency_s = time.perf_counter() - start
    return record


def closed_loop(url: str, model: str, prompts: Sequence[str], *, concurrency: int,
                max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                request_timeout_s: float = 600.0, run_timeout_s: float = 3600.0) -> dict:
    """Replays ``prompts`` with ``concurrency`` closed-loop users; returns the summary dict.

    No new request starts after ``run_timeout_s``; the prompts not sent then are counted as
    ``not_sent``.
    """
    if concurrency < 1 or not prompts:
        raise ValueError("need concurrency >= 1 and at least one prompt")
    pending = list(prompts)[::-1]
    records: list[RequestRecord] = []
    lock = threading.Lock()
    start = time.perf_counter()

    def user():
        while True:
            with lock:
                if not pending or time.perf_counter() - start > run_timeout_s:
                    return
                prompt = pending.pop()
            record = chat_stream(url, model, prompt, max_tokens=max_tokens,
                                 temperature=temperature, top_p=top_p, timeout_s=request_timeout_s)
            with lock:
                records.append(record)

    threads = [threading.Thread(target=user, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    ok = [r for r in records if r.ok]
    latencies = [r.latency_s for r in ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tokens = sum(r.completion_tokens for r in ok)
    return dict(
        concurrency=concurrency, requests=len(prompts), completed=len(ok),
        failed=len(records) - len(ok), not_sent=len(pending), wall_s=wall,
        completion_tokens=tokens, tokens_per_s=tokens / wall if wall else 0.0,
        latency_p50_s=_percentile(latencies, 50), latency_p99_s=_percentile(latencies, 99),
        ttft_p50_s=_percentile(ttfts, 50), ttft_p99_s=_percentile(ttfts, 99),
        mean_latency_s=statistics.fmean(latencies) if latencies else None,
        finish_reasons={reason: sum(r.finish_reason == reason for r in ok)
                        for reason in sorted({r.finish_reason for r in ok})},
        errors=sorted({r.error for r in records if r.error})[:5])


def eval_texts(datasets: Sequence[str], count: int, *, max_chars: int,
               data_dir=None) -> list[str]:
    """First turns of the eval sets, round-robin, at most ``max_chars`` characters each.

    Raises:
      ValueError: an unknown or missing set, or fewer than ``count`` such prompts.
    """
    from dspark_jax.prompts import load_benchmark

    turns = [load_benchmark(name, data_dir) for name in datasets]
    texts = [t for i in range(max(len(x) for x in turns)) for x in turns
             if i < len(x) and len(t := x[i]) <= max_chars]
    if len(texts) < count:
        raise ValueError(f"only {len(texts)} prompts of at most {max_chars} characters in "
                         f"{', '.join(datasets)}; asked for {count}")
    return texts[:count]


def server_model(url: str, timeout_s: float = 30.0) -> str:
    """The model a server serves (``GET /v1/models``).

    Raises:
      ValueError: no server answers at ``url``.
    """
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/v1/models", timeout=timeout_s) as response:
            return json.loads(response.read())["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError) as error:
        raise ValueError(f"no dspark-jax / OpenAI server answers at {url}: {error}") from None


def markdown_table(results: Sequence[dict]) -> str:
    def ms(x):
        return "-" if x is None else f"{1000 * x:.0f}"

    lines = ["| C | requests | completed | failed | tokens/s | latency p50 / p99 (ms) | "
             "TTFT p50 / p99 (ms) |", "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['concurrency']} | {r['requests']} | {r['completed']} | "
                     f"{r['failed'] + r['not_sent']} | {r['tokens_per_s']:.1f} | "
                     f"{ms(r['latency_p50_s'])} / {ms(r['latency_p99_s'])} | "
                     f"{ms(r['ttft_p50_s'])} / {ms(r['ttft_p99_s'])} |")
    return "\n".join(lines)
