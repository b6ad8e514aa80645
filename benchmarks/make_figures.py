"""The paper's confidence figures from `dspark-jax eval` output folders (issue 6).

    python benchmarks/make_figures.py --eval benchmarks/results/eval_t0 --dspark dspark \
        --output benchmarks/results/figures

* ``suffix_decay.png``: conditional acceptance per block position by domain, one line per
  drafter found in the eval folder (paper Fig. 2);
* ``threshold_sweep.png``: the DSpark drafter's verified tokens accepted / rejected as a static
  threshold rises, by domain (paper Fig. 5);
* ``reliability.png``: reliability diagram of cumulative survival, raw vs STS-calibrated; the
  temperatures are fitted on half of the requests (split by request, seeded) and the diagram
  and metrics are those of the other half (paper Fig. 6). ``calibration.json`` beside them
  holds the temperatures and the before/after ECE, AUROC and Brier.

Each PNG has its JSON beside it; ``dspark_jax.evaluation.figures.plot_from_json`` redraws it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dspark_jax.evaluation import (AcceptanceTrace, calibrate, concatenate_traces,
                                   split_by_request)
from dspark_jax.checkpoints.calibration_file import calibration_text
from dspark_jax.evaluation.figures import (conditional_acceptance_data, reliability_data,
                                           threshold_sweep_data, write_figure)
from dspark_jax.evaluation.suite import BENCHMARKS


def domain_traces(folder: Path) -> dict[str, AcceptanceTrace]:
    """{domain: the concatenated traces of that domain's benchmarks} of one drafter folder."""
    by_domain: dict[str, list[AcceptanceTrace]] = {}
    for path in sorted(folder.glob("*.npz")):
        if path.stem in BENCHMARKS:
            by_domain.setdefault(BENCHMARKS[path.stem][0], []).append(AcceptanceTrace.load(path))
    if not by_domain:
        raise SystemExit(f"no benchmark traces (*.npz) in {folder}")
    return {d: concatenate_traces(t) for d, t in by_domain.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--eval", required=True, help="output folder of `dspark-jax eval`")
    parser.add_argument("--dspark", required=True, help="label of the DSpark drafter in it")
    parser.add_argument("--output", required=True)
    parser.add_argument("--seed", type=int, default=0, help="fit / report split of requests")
    args = parser.parse_args(argv)
    root, out = Path(args.eval), Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    drafters = {p.name: domain_traces(p) for p in sorted(root.iterdir()) if p.is_dir()}
    if args.dspark not in drafters:
        raise SystemExit(f"no drafter {args.dspark!r} in {root}: {', '.join(drafters)}")
    dspark = drafters[args.dspark]
    written = [write_figure(conditional_acceptance_data(drafters), out / "suffix_decay.png"),
               write_figure(threshold_sweep_data(dspark), out / "threshold_sweep.png")]
    pooled = concatenate_traces(list(dspark.values()))
    temperatures, fit = calibrate(pooled, fit_fraction=0.5, seed=args.seed)
    _, heldout = split_by_request(pooled, 0.5, args.seed)
    written.append(write_figure(reliability_data(heldout, temperatures,
                                                 title=f"{args.dspark}, held-out requests"),
                                out / "reliability.png"))
    (out / "calibration.json").write_text(calibration_text(temperatures, fit))
    for png, data in written:
        print(f"wrote {png} ({data.name})")
    for when in ("before", "after"):
        m = fit["heldout"][when]
        print(f"{when:>6}: ECE {m['ece_mean']:.4f} AUROC {m['auroc_mean']:.4f} "
              f"Brier {m['brier_mean']:.4f}")
    print(json.dumps(dict(temperatures=[round(float(t), 3) for t in temperatures])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
