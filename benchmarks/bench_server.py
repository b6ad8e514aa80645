"""Load test of ``dspark-jax serve`` on loopback: C concurrent streaming users, nothing lost.

Starts ``dspark-jax serve`` (the embedded SmolLM2 target, a drafter, the production scheduler
with this machine's cached SPS profile) on 127.0.0.1 as a subprocess, waits for ``/health``,
replays eval first turns closed-loop at each concurrency (once with 2 new tokens per request to
compile the admissions the load needs, then measured) through ``serve-bench --url``'s load
generator (``serving.http_load``; every request bounded in time, the run bounded in count and
time), reads ``/metrics``, stops the server and writes one JSON.

    python benchmarks/bench_server.py --concurrency 1 64 --requests 64 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timezone

from _common import ROOT, cpu_name

from dspark_jax.serving import http_load


def wait_for_health(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if json.loads(response.read()).get("status") == "ok":
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"the server did not become healthy in {timeout_s:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--drafter", default="dspark-smollm2-135m-campaign",
                        help="drafter name or folder; 'none' for autoregressive serving")
    parser.add_argument("--verify", default="production")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--requests", type=int, default=64, help="prompts per concurrency")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--datasets", default="gsm8k,humaneval,mt-bench")
    parser.add_argument("--max-prompt-chars", type=int, default=1200)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--startup-timeout", type=float, default=1200.0)
    parser.add_argument("--run-timeout", type=float, default=1200.0)
    parser.add_argument("--output", default=str(ROOT / "benchmarks/results/server_load.json"))
    args = parser.parse_args()

    url = f"http://127.0.0.1:{args.port}"
    command = [sys.executable, "-m", "dspark_jax.cli", "serve", "--model", args.model,
               "--port", str(args.port), "--max-slots", str(args.slots),
               "--max-len", str(args.max_len), "--max-queue", str(max(args.concurrency)),
               "--log-level", "warning"]
    if args.drafter != "none":
        command += ["--drafter", args.drafter, "--verify", args.verify]
    texts = http_load.eval_texts(args.datasets.split(","), args.requests,
                                 max_chars=args.max_prompt_chars)
    started = time.perf_counter()
    proc = subprocess.Popen(command, cwd=ROOT, env=dict(os.environ))
    try:
        wait_for_health(url, proc, args.startup_timeout)
        startup_s = time.perf_counter() - started
        for concurrency in args.concurrency:  # compiles the admissions this load needs
            http_load.closed_loop(url, args.model, texts, concurrency=concurrency, max_tokens=2,
                                  run_timeout_s=args.run_timeout)
        results = []
        for concurrency in args.concurrency:
            result = http_load.closed_loop(url, args.model, texts, concurrency=concurrency,
                                           max_tokens=args.max_new_tokens,
                                           temperature=args.temperature,
                                           run_timeout_s=args.run_timeout)
            results.append(result)
            print(http_load.markdown_table([result]).splitlines()[-1], flush=True)
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
            metrics = response.read().decode()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    report = dict(command=" ".join(sys.argv), server=" ".join(command[2:]), machine=cpu_name(),
                  date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  startup_s=startup_s, max_new_tokens=args.max_new_tokens,
                  temperature=args.temperature, results=results,
                  metrics=[line for line in metrics.splitlines() if not line.startswith("#")])
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)
    print(http_load.markdown_table(results))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
