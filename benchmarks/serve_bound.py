"""How much any verification policy can gain over gamma 1, from a serve-bench result (issue 7).

    python benchmarks/serve_bound.py benchmarks/results/serve_bench_c1_c4/serve_bench.json \
        benchmarks/results/serve_bench_c16_c64/serve_bench.json

The bound is per decode step, at concurrency C with R = C requests decoding:

* a step verifies R anchors plus some drafts; every emitted token beyond the R anchors' is an
  accepted draft, and a policy cannot get more accepted drafts from a block than verifying the
  whole block does, so a step emits at most R * tau_full tokens in expectation (tau_full: the
  measured tau of the ``full`` policy);
* a step costs at least the step time of B = R tokens, the cheapest forward that carries every
  anchor (the SPS table made non-increasing in B, so that a noisy cheaper bucket above R counts).

So no policy beats R * tau_full * SPS(R) tokens/s: an oracle that verifies exactly the drafts
that will be accepted, at no cost. Gamma 1 under the same per-step model gives
R * tau_1 * SPS(2R). Their ratio bounds the gain of any policy over gamma 1; the measured
ratios of prefix and production against fixed1 (which also include admission prefills) are
printed beside it. Writes the table as JSON next to the first input (``serve_bound.json``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def step_bound(table, tau_full: float, tau_1: float, requests: int) -> dict:
    """The per-step bound at R = ``requests`` from an SPS table ``sps[0..Bmax]`` (steps/s)."""
    sps = np.asarray(table, np.float64)
    envelope = np.maximum.accumulate(sps[::-1])[::-1]  # max over B' >= B: non-increasing
    oracle = requests * tau_full * envelope[requests]
    gamma_1 = requests * tau_1 * sps[2 * requests]
    return dict(step_ms_anchors=1000 / sps[requests], step_ms_gamma_1=1000 / sps[2 * requests],
                tau_full=tau_full, tau_1=tau_1, oracle_tokens_per_s=oracle,
                gamma_1_tokens_per_s=gamma_1, bound_gain=oracle / gamma_1 - 1)


def bound_rows(result: dict) -> list[dict]:
    """One row per concurrency of a serve-bench result that ran ``full`` and ``fixed1``."""
    rows = {(r["policy"], r["concurrency"]): r for r in result["rows"]}
    out = []
    for users in result["config"]["concurrency"]:
        full, fixed1 = rows.get(("full", users)), rows.get(("fixed1", users))
        profile = result["sps"].get(str(users), result["sps"].get(users))
        if full is None or fixed1 is None or profile is None:
            continue
        row = dict(concurrency=users, **step_bound(profile["table"], full["tau"], fixed1["tau"],
                                                    users))
        for policy in ("prefix", "production"):
            if (policy, users) in rows:
                row[f"measured_{policy}_gain"] = (rows[(policy, users)]["tokens_per_s"]
                                                  / fixed1["tokens_per_s"] - 1)
        out.append(row)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="+", help="serve_bench.json files")
    args = parser.parse_args(argv)
    rows = []
    for path in args.results:
        rows += bound_rows(json.loads(Path(path).read_text()))
    if not rows:
        parser.error("no concurrency with both a full and a fixed1 row")
    print("| C | step ms, B = R | step ms, B = 2R | tau full | tau gamma 1 | bound over gamma 1 "
          "| measured prefix | measured production |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        measured = [f"{r[k]:+.0%}" if k in r else "-"
                    for k in ("measured_prefix_gain", "measured_production_gain")]
        print(f"| {r['concurrency']} | {r['step_ms_anchors']:.1f} | {r['step_ms_gamma_1']:.1f} "
              f"| {r['tau_full']:.3f} | {r['tau_1']:.3f} | {r['bound_gain']:+.0%} | "
              + " | ".join(measured) + " |")
    output = Path(args.results[0]).with_name("serve_bound.json")
    output.write_text(json.dumps(dict(inputs=args.results, rows=rows), indent=1))
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
