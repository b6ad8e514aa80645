"""The learning curve of a training run (issue 18): held-out metrics against steps, with a plot.

    python benchmarks/learning_curve.py --workdir runs/campaign_dspark [--label dspark] \
        [--offset STEPS] [--workdir runs/campaign_dflash --label dflash] \
        [--include benchmarks/results/learning_curve.json]

Reads each run's ``heldout.jsonl`` (written by the trainer when ``train.heldout_dir`` is set:
one epoch of the held-out folders, the same anchors at every evaluation) and ``metrics.jsonl``
(training batches); ``--include`` adds the runs of an earlier results JSON, whose workdirs
may be gone (an earlier machine's), before them. Prints a Markdown table per run (held-out tau_probabilistic, accept_rate@0,
@1, @3, and tau with the Markov head zeroed, W2 = 0, where the run has one) and writes
``benchmarks/results/learning_curve.json`` and ``.png`` (held-out tau and tau with W2 = 0 against
steps; training-batch tau behind them; beside, each run's held-out acceptance by block
position at its last evaluation, the suffix decay, with the fall from position 1 to 6).

``--fit-from STEP`` fits held-out tau at the runs' last evaluations from STEP on (the annealed
ends of a campaign's segments) as a + b ln(step), prints the gain per doubling of the steps and
the steps at which the fit reaches each ``--reach`` tau, draws it, and keeps it in the JSON:

    python benchmarks/learning_curve.py --include benchmarks/results/learning_curve.json \
        --fit-from 4000 --reach 2.0 2.1 2.5
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from _common import ROOT, cpu_name


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file; for repeated steps (a resumed run) the last one wins."""
    if not path.exists():
        raise SystemExit(f"{path} does not exist (train with --train.heldout_dir=... to write it)")
    by_step = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def positions(record: dict) -> list[float]:
    """accept_rate@0, @1, ... of a held-out record: the acceptance at each block position."""
    return [record[f"accept_rate@{k}"] for k in range(len(record)) if f"accept_rate@{k}" in record]


def suffix_fall(accept: list[float]) -> float:
    """The relative change of acceptance from block position 1 to 6 (negative: it falls)."""
    return accept[5] / accept[0] - 1


def log_fit(points: list[tuple[int, float]], reach: list[float]) -> dict:
    """The least-squares fit tau = a + b ln(step) of (step, tau) points, the gain per doubling
    of the steps and the steps at which it reaches each tau in ``reach``."""
    import numpy as np

    if len({step for step, _ in points}) < 2:
        raise SystemExit("--fit-from: fewer than two runs end at or after that step")
    b, a = np.polyfit(np.log([step for step, _ in points]), [tau for _, tau in points], 1)
    return dict(points=points, a=float(a), b=float(b), per_doubling=float(b * math.log(2)),
                reach={f"{tau:g}": float(math.exp((tau - a) / b)) if b > 0 else None
                       for tau in reach})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", action="append", default=[])
    parser.add_argument("--label", action="append", default=[])
    parser.add_argument("--offset", action="append", type=int, default=[],
                        help="steps before each run's step 0 (a warm start), one per --workdir")
    parser.add_argument("--include", type=Path,
                        help="an earlier learning_curve.json whose runs to plot first")
    parser.add_argument("--fit-from", type=int,
                        help="fit held-out tau at the runs' last evaluations from this step on "
                             "against ln(step)")
    parser.add_argument("--reach", type=float, nargs="*", default=[],
                        help="with --fit-from: the held-out taus to give the fit's steps for")
    parser.add_argument("--output", default=str(ROOT / "benchmarks/results/learning_curve.json"))
    args = parser.parse_args(argv)
    if not args.workdir and not args.include:
        parser.error("give a run's --workdir or an earlier results JSON to --include")
    labels = args.label + [Path(w).name for w in args.workdir[len(args.label):]]
    offsets = args.offset + [0] * (len(args.workdir) - len(args.offset))
    runs = dict(json.loads(args.include.read_text())["runs"]) if args.include else {}
    for label, workdir, offset in zip(labels, map(Path, args.workdir), offsets):
        heldout = [dict(r, step=r["step"] + offset) for r in read_jsonl(workdir / "heldout.jsonl")]
        train_metrics = [dict(r, step=r["step"] + offset) for r in read_jsonl(workdir / "metrics.jsonl")
                         ] if (workdir / "metrics.jsonl").exists() else []
        runs[label] = dict(workdir=str(workdir), heldout=heldout,
                           train=[(r["step"], r["tau_probabilistic"]) for r in train_metrics])
        print(f"\n{label} ({workdir}):\n")
        print("| step | tau | accept@0 | accept@1 | accept@3 | tau, W2 = 0 |")
        print("|---|---|---|---|---|---|")
        for r in heldout:
            zero = r.get("w2_zero", {}).get("tau_probabilistic")
            print(f"| {r['step']} | {r['tau_probabilistic']:.4f} | {r['accept_rate@0']:.4f} | "
                  f"{r['accept_rate@1']:.4f} | {r['accept_rate@3']:.4f} | "
                  + (f"{zero:.4f}" if zero is not None else "-") + " |")

    print("\nHeld-out acceptance by block position at each run's last evaluation (teacher-forced: "
          "each position given a correct prefix):\n")
    last = {label: (run["heldout"][-1]["step"], positions(run["heldout"][-1]))
            for label, run in runs.items()}  # {label: (step, acceptance by block position)}
    width = max(len(accept) for _, accept in last.values())
    print("| run | step | " + " | ".join(f"pos {k + 1}" for k in range(width))
          + " | fall, pos 1 -> 6 |")
    print("|---|---|" + "---|" * (width + 1))
    for label, (step, accept) in last.items():
        print(f"| {label} | {step} | " + " | ".join(f"{a:.4f}" for a in accept)
              + f" | {suffix_fall(accept):+.1%} |")

    fit = None
    if args.fit_from is not None:
        fit = log_fit(sorted((run["heldout"][-1]["step"], run["heldout"][-1]["tau_probabilistic"])
                             for run in runs.values()
                             if run["heldout"][-1]["step"] >= args.fit_from), args.reach)
        fit["from"] = args.fit_from
        print(f"\nHeld-out tau at the last evaluations from step {args.fit_from} on "
              f"({len(fit['points'])} runs): {fit['a']:.4f} + {fit['b']:.4f} ln(step), "
              f"{fit['per_doubling']:+.4f} per doubling of the steps")
        for tau, steps in fit["reach"].items():
            print(f"  tau {tau}: " + (f"step {steps:,.0f}" if steps else "not reached (no gain)"))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.lines import Line2D

    # One color per run, named once in the figure's legend below the plots; the marker says
    # what a curve is (the key in the upper plot).
    legend_in = 0.17 * len(runs) + 0.3  # inches below the plots for the runs' names
    fig, (ax, by_position) = plt.subplots(1, 2, figsize=(13, 4.5 + legend_in), width_ratios=(2, 1))
    handles = []
    for i, (label, run) in enumerate(runs.items()):
        color = f"C{i}"
        steps = [r["step"] for r in run["heldout"]]
        handles += ax.plot(steps, [r["tau_probabilistic"] for r in run["heldout"]], "o-",
                           color=color, markersize=4, label=label)
        zero = [(r["step"], r["w2_zero"]["tau_probabilistic"]) for r in run["heldout"] if "w2_zero" in r]
        if zero:
            ax.plot(*zip(*zero), "s--", color=color, markersize=3, alpha=0.7)
        if run["train"]:
            ax.plot(*zip(*run["train"]), color=color, alpha=0.2, linewidth=0.8)
    key = [Line2D([], [], color="gray", marker="o", label="held-out"),
           Line2D([], [], color="gray", marker="s", linestyle="--", label="held-out, W2 = 0"),
           Line2D([], [], color="gray", alpha=0.4, label="training batches")]
    if fit:
        first, last_step = fit["points"][0][0], fit["points"][-1][0]
        steps = [first + (last_step - first) * i / 50 for i in range(51)]
        key += ax.plot(steps, [fit["a"] + fit["b"] * math.log(s) for s in steps], ":",
                       color="black", linewidth=1.2,
                       label=f"fit of the runs' ends: {fit['per_doubling']:+.3f} per doubling")
    ax.set_xlabel("step")
    ax.set_ylabel("tau_probabilistic (teacher-forced, block 7)")
    ax.grid(alpha=0.3)
    ax.legend(handles=key, fontsize=8, loc="upper left")
    for i, (label, (step, accept)) in enumerate(last.items()):
        by_position.plot(range(1, len(accept) + 1), accept, "o-", color=f"C{i}", markersize=4)
    by_position.set_xlabel("block position")
    by_position.set_ylabel("held-out acceptance, last evaluation")
    by_position.set_ylim(bottom=0)
    by_position.grid(alpha=0.3)
    fig.legend(handles=handles, loc="lower left", fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, legend_in / (4.5 + legend_in), 1, 1))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out.with_suffix(".png"), dpi=120)
    out.write_text(json.dumps(dict(machine=cpu_name(), date=time.strftime("%Y-%m-%d"), runs=runs)
                              | ({"fit": fit} if fit else {}), indent=1))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
