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
"""

from __future__ import annotations

import argparse
import json
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", action="append", required=True)
    parser.add_argument("--label", action="append", default=[])
    parser.add_argument("--offset", action="append", type=int, default=[],
                        help="steps before each run's step 0 (a warm start), one per --workdir")
    parser.add_argument("--include", type=Path,
                        help="an earlier learning_curve.json whose runs to plot first")
    parser.add_argument("--output", default=str(ROOT / "benchmarks/results/learning_curve.json"))
    args = parser.parse_args(argv)
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
    ax.set_xlabel("step")
    ax.set_ylabel("tau_probabilistic (teacher-forced, block 7)")
    ax.grid(alpha=0.3)
    ax.legend(handles=[Line2D([], [], color="gray", marker="o", label="held-out"),
                       Line2D([], [], color="gray", marker="s", linestyle="--", label="held-out, W2 = 0"),
                       Line2D([], [], color="gray", alpha=0.4, label="training batches")],
              fontsize=8, loc="upper left")
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
    out.write_text(json.dumps(dict(machine=cpu_name(), date=time.strftime("%Y-%m-%d"), runs=runs),
                              indent=1))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
