"""Recipe ablations at one fixed budget (issue 18): initialisations and learning rates.

    python benchmarks/recipe_ablation.py --config configs/dspark_smollm2_135m.py \
        --data data/campaign/math data/campaign/code data/campaign/chat \
        --heldout data/campaign/heldout_math data/campaign/heldout_code data/campaign/heldout_chat \
        --steps 60 --workdir runs/ablation \
        --variant reference= \
        --variant zero_w2=train.markov_init=zero_w2 \
        --variant bigram=train.markov_init=bigram \
        --variant bigram+layers=train.markov_init=bigram,train.draft_layers_from=(28,29)

Every variant trains ``--steps`` steps from the same config, data snapshot, seed and anchors,
differing only in its overrides (``path=value`` pairs separated by commas outside brackets).
Before training, the data and held-out folders are frozen into ``WORKDIR/data`` and
``WORKDIR/heldout`` (hard links of the shards present now and their manifest), so a data job
still writing to them changes nothing; a rerun reuses the snapshots and resumes each variant
from its checkpoints. For each variant the trainer's learning curve (``train.heldout_dir``: one
epoch of the held-out snapshot, the same anchors for all) gives the held-out metrics at step 0
(the recipe's initialisation) and at the end, and the end again with the Markov head zeroed
(W2 = 0: what the head contributes). Writes ``WORKDIR/ablation.json``,
``benchmarks/results/recipe_ablation.json``, a Markdown table and
``benchmarks/results/recipe_ablation.png`` (training-batch tau against steps).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import time
from pathlib import Path

from _common import ROOT, command_line, cpu_name

from dspark_jax.experiment import apply_overrides, load_config
from dspark_jax.training.data import load_manifest, write_manifest
from dspark_jax.training.trainer import train

KEYS = ("tau_probabilistic", "accept_rate@0", "accept_rate@1", "accept_rate@3", "ce_loss", "l1_loss")


def snapshot(data_dirs: list[str], into: Path) -> list[str]:
    """Freezes prepare-data folders: hard links of their listed shards plus the manifest."""
    out = []
    for i, src in enumerate(map(Path, data_dirs)):
        dst = into / f"{i}_{src.name}"
        if not (dst / "manifest.json").exists():
            manifest = load_manifest(src)
            if manifest is None:
                raise SystemExit(f"{src} is not a prepare-data folder (no manifest.json)")
            tmp = dst.with_name(dst.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for entry in manifest["files"]:
                os.link(src / entry["file"], tmp / entry["file"])
            write_manifest(tmp, manifest)
            tmp.rename(dst)
        out.append(str(dst))
    return out


def split_overrides(text: str) -> list[str]:
    """'a=1,b=(2,3)' -> ['a=1', 'b=(2,3)'] (commas inside brackets stay)."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return [p for p in parts + [current] if p.strip()]


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        steps, taus = zip(*r["curve"]) if r["curve"] else ((), ())
        ax.plot(steps, taus, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training-batch tau_probabilistic")
    ax.set_title("Recipe ablation (same data, seed and budget)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--data", nargs="+", required=True)
    parser.add_argument("--feature-dir", nargs="*", default=(),
                        help="feature caches of --data (same order), made from the snapshot")
    parser.add_argument("--heldout", nargs="+", required=True)
    parser.add_argument("--heldout-feature-dir", nargs="*", default=(),
                        help="feature caches of the held-out snapshot (same order)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--workdir", default="runs/ablation")
    parser.add_argument("--variant", action="append", required=True, help="NAME=overrides")
    parser.add_argument("--set", action="append", default=[], help="overrides for every variant")
    parser.add_argument("--output", default=str(ROOT / "benchmarks/results/recipe_ablation.json"))
    args = parser.parse_args(argv)
    workdir = Path(args.workdir)
    data = snapshot(args.data, workdir / "data")
    heldout = snapshot(args.heldout, workdir / "heldout")
    results = {}
    for spec in args.variant:
        name, _, overrides = spec.partition("=")
        if not re.fullmatch(r"[\w.+-]+", name):
            raise SystemExit(f"variant name {name!r}: use letters, digits, _ . + -")
        config = load_config(args.config)
        apply_overrides(config, [*args.set, *split_overrides(overrides),
                                 f"train.max_steps={args.steps}",
                                 f"train.data_dir={tuple(data)!r}",
                                 f"train.feature_dir={tuple(args.feature_dir)!r}",
                                 f"train.heldout_dir={tuple(heldout)!r}",
                                 f"train.heldout_feature_dir={tuple(args.heldout_feature_dir)!r}",
                                 "train.heldout_every=0"])
        run = workdir / name
        began = time.perf_counter()
        train(config, run)
        train_s = time.perf_counter() - began
        with open(run / "heldout.jsonl") as f:
            evals = {r["step"]: r for r in map(json.loads, f)}
        rows = {"step 0": evals[0], "final": evals[args.steps]}
        if "w2_zero" in evals[args.steps]:
            rows["final, W2 = 0"] = evals[args.steps]["w2_zero"]
        with open(run / "metrics.jsonl") as f:
            curve = [(r["step"], r["tau_probabilistic"]) for r in map(json.loads, f)]
        results[name] = dict(overrides=overrides, heldout=rows, curve=curve, train_s=train_s)
        print(f"{name}: " + ", ".join(f"{k} {v['tau_probabilistic']:.4f}" for k, v in rows.items()),
              flush=True)
    print("| variant | held-out | " + " | ".join(KEYS) + " |")
    print("|---" * (len(KEYS) + 2) + "|")
    for name, r in results.items():
        for when, m in r["heldout"].items():
            print(f"| {name} | {when} | " + " | ".join(f"{m[k]:.4g}" for k in KEYS) + " |")
    record = dict(command=command_line(__file__, argv),
                  machine=cpu_name(), date=time.strftime("%Y-%m-%d"), steps=args.steps,
                  data={d: load_manifest(d)["num_loss_tokens"] for d in data},
                  heldout={d: load_manifest(d)["num_loss_tokens"] for d in heldout}, results=results)
    for path in (workdir / "ablation.json", Path(args.output)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1))
    plot(results, Path(args.output).with_suffix(".png"))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
