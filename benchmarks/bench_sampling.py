"""Cost of one categorical draw per row: the Gumbel-max draw against the inverse-CDF draw.

    python benchmarks/bench_sampling.py

(options: --vocab 49152 --rows 10 80 512 --repeats 10 --output benchmarks/results/sampling.json)

``gumbel`` is ``jax.random.categorical`` on the log-probabilities (V uniforms and logarithms per
row), the project's sampler until it was replaced; ``inverse_cdf`` is
``sampling.sample_from_probs`` (two uniforms per row, a two-level inverse CDF). Rows: 10 is one
batch of the eval's block draws per position, 80 a block of 8 for 10 requests, 512 a block of 8
for 64 serving slots. Both are jitted, warmed up, timed alternately, and reported as medians and
as the ratio gumbel / inverse_cdf measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _common import ROOT, command_line, cpu_name, timed


def gumbel_draw(key, probs):
    import jax
    import jax.numpy as jnp

    logp = jnp.where(probs > 0, jnp.log(jnp.where(probs > 0, probs, 1.0)), -jnp.inf)
    return jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--rows", type=int, nargs="+", default=[10, 80, 512])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks/results/sampling.json")
    args = parser.parse_args()

    import jax

    from dspark_jax.decoding.sampling import sample_from_probs

    samplers = {"gumbel": jax.jit(gumbel_draw), "inverse_cdf": jax.jit(sample_from_probs)}
    results = []
    for rows in args.rows:
        probs = jax.nn.softmax(3.0 * jax.random.normal(jax.random.key(0), (rows, args.vocab)), -1)
        key = jax.random.key(1)
        times = {name: [] for name in samplers}
        for fn in samplers.values():
            timed(lambda fn=fn: fn(key, probs))  # compile and warm up
        for _ in range(args.repeats):
            for name, fn in samplers.items():
                times[name].append(timed(lambda fn=fn: fn(key, probs)))
        ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        results.append(dict(rows=rows, gumbel_ms=ms["gumbel"], inverse_cdf_ms=ms["inverse_cdf"],
                            ratio=ms["gumbel"] / ms["inverse_cdf"]))
        print(f"rows {rows:4d}: gumbel {ms['gumbel']:8.2f} ms  inverse_cdf "
              f"{ms['inverse_cdf']:6.2f} ms  ratio {results[-1]['ratio']:6.1f}x")
    report = dict(machine=cpu_name(), backend=jax.default_backend(), vocab=args.vocab,
                  repeats=args.repeats, date=time.strftime("%Y-%m-%d %H:%M:%S"),
                  command=command_line(__file__), results=results)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
