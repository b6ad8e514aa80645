"""Before/after timings of the decoding engine, runnable against an older checkout too.

Two measurements on SmolLM2-135M-Instruct (float32) with the packaged DSpark drafter:

* ``step``: seconds per serving step (``Engine.step``: admissions, one round, host read) with
  4 slots serving the first 4 gsm8k prompts (48 new tokens, greedy, ``--policy``), after one
  untimed pass; ``--repeats`` passes.
* ``generate``: wall seconds of ``generate`` on 32 math training prompts (2400..2431) with the
  data-regeneration sampling (T 0.7, top-p 0.8, top-k 20; 96 new tokens), after one untimed
  call; ``--repeats`` calls.

    python benchmarks/engine_before_after.py step --policy fixed
    python benchmarks/engine_before_after.py generate

For the "before" figure run it with ``PYTHONPATH`` set to a worktree of the older commit
(``git worktree add /tmp/old <rev>``), from a directory outside this checkout; it imports the
engine from wherever that commit had it (``serving`` before the one engine). Alternate the two
runs and compare on an otherwise idle machine; the printed JSON has the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def _imports():
    """(Engine, chat_ids, load_benchmark, layout name) from this checkout or an older one."""
    import dspark_jax

    root = Path(dspark_jax.__file__).parent
    if (root / "engine").is_dir():
        from dspark_jax.engine import Engine
        from dspark_jax.prompts import chat_ids, load_benchmark
        return Engine, chat_ids, load_benchmark, "one engine"
    from dspark_jax.evaluation.suite import load_benchmark
    from dspark_jax.generation import chat_ids
    from dspark_jax.serving import Engine
    return Engine, chat_ids, load_benchmark, "static batch + serving engine"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["step", "generate"])
    parser.add_argument("--policy", default="fixed", help="step: full, fixed (gamma 1), ...")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data-dir", type=Path, default=DATA)
    args = parser.parse_args()

    import dspark_jax
    from dspark_jax.jsonl import read_jsonl

    Engine, chat_ids, load_benchmark, layout = _imports()
    target = dspark_jax.load_target("smollm2-135m-instruct")
    load = list(os.getloadavg())
    times, counts = [], []
    if args.what == "step":
        drafter = dspark_jax.load_drafter("dspark-smollm2-135m", target)
        prompts = [chat_ids(target.tokenizer, p)
                   for p in load_benchmark("gsm8k", args.data_dir / "eval", 4)]
        params = {"gamma": 1} if args.policy == "fixed" else None
        engine = Engine(target, drafter, slots=4, max_len=512, policy=args.policy,
                        policy_params=params)

        def once():
            for p in prompts:
                engine.submit(p, max_new_tokens=48)
            start, steps = time.perf_counter(), 0
            while engine.busy:
                engine.step()
                steps += 1
            return (time.perf_counter() - start) / steps, steps
    else:
        texts = [r["turns"][0] for _, r in
                 read_jsonl(args.data_dir / "train" / "math_prompts.jsonl")][2400:2432]
        ids = [chat_ids(target.tokenizer, t) for t in texts]
        kw = dict(max_new_tokens=96, temperature=0.7, top_p=0.8, top_k=20, seed=1)

        def once():
            results = dspark_jax.generate(target, ids, **kw)
            return results[0].stats["wall_s"], sum(r.stats["new_tokens"] for r in results)

    once()  # compiles
    for _ in range(args.repeats):
        seconds, count = once()
        times.append(seconds)
        counts.append(count)
    print(json.dumps(dict(what=args.what, layout=layout, policy=args.policy, seconds=times,
                          counts=counts, load_average=[load, list(os.getloadavg())],
                          date=time.strftime("%Y-%m-%d %H:%M"))))


if __name__ == "__main__":
    main()
