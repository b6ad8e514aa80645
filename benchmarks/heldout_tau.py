"""Held-out teacher-forced metrics of trained drafters against their initialisation (issue 5).

    python benchmarks/heldout_tau.py --config configs/dspark_smollm2_135m.py \
        --drafter dspark=runs/dspark_smollm2/drafter \
        --config configs/dflash_smollm2_135m.py --drafter dflash=runs/dflash_smollm2/drafter \
        --data data/heldout_math data/heldout_chat

Each ``--drafter LABEL=PATH`` pairs with the ``--config`` before it (the same count, in order);
the untrained drafter of that config (``init_drafter`` with the training seed: the run's step
0) is evaluated too, unless ``--skip-init``. Every drafter sees one epoch of the held-out
folders packed with the same seed, so the same anchors; ``--max-batches 8`` keeps the first 8
batches, as a training run's learning curve does with ``train.heldout_batches=8``, so the
numbers compare with its ``heldout.jsonl``; ``--feature-dir`` (one cache per folder, from
``prepare-features``) skips the target forward. Writes benchmarks/results/heldout_tau.json and
prints a table of tau_probabilistic, accept_rate@0 and the loss terms.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from _common import command_line, cpu_name

import dspark_jax
from dspark_jax.experiment import load_config
from dspark_jax.training.heldout import heldout_metrics


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", action="append", required=True)
    parser.add_argument("--drafter", action="append", required=True, help="LABEL=PATH")
    parser.add_argument("--data", nargs="+", required=True, help="held-out prepared folders")
    parser.add_argument("--feature-dir", nargs="+", help="feature caches of --data, same order")
    parser.add_argument("--max-batches", type=int, help="only the epoch's first batches")
    parser.add_argument("--skip-init", action="store_true", help="not the untrained drafters")
    parser.add_argument("--output", default="benchmarks/results/heldout_tau.json")
    args = parser.parse_args(argv)
    if len(args.config) != len(args.drafter):
        parser.error("give one --config per --drafter")
    rows = {}
    target = None
    for config_path, spec in zip(args.config, args.drafter):
        label, path = spec.split("=", 1)
        config = load_config(config_path)
        target = target or dspark_jax.load_target(config.target)
        drafters = [] if args.skip_init else [
            (f"{label} (step 0)", dspark_jax.init_drafter(target, config, seed=config.train.seed))]
        for name, drafter in drafters + [(label, dspark_jax.load_drafter(path, target))]:
            rows[name] = heldout_metrics(drafter, args.data, config.train,
                                         max_batches=args.max_batches, feature_dir=args.feature_dir)
    keys = ("tau_probabilistic", "accept_rate@0", "accept_rate@3", "ce_loss", "l1_loss",
            "valid_blocks")
    print("| drafter | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, m in rows.items():
        print(f"| {name} | " + " | ".join(f"{m[k]:.4g}" for k in keys) + " |")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(command=command_line(__file__, argv),
                                   machine=cpu_name(), date=time.strftime("%Y-%m-%d"),
                                   data=args.data, results=rows), indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
