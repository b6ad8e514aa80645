"""Train a drafter on a Cloud TPU VM or pod slice: create it, copy the project, install, train.

Every host of the slice runs the same ``dspark-jax train`` command; ``--distributed`` makes each
call ``jax.distributed.initialize()``, which discovers the slice's hosts on TPU by itself.

    python launch/tpu_pod.py --name dspark --zone us-east5-a --accelerator v5p-32 \
        --config configs/dspark_qwen3_4b.py [--workdir gs://bucket/runs/qwen3] [--dry-run] \
        [--remote-paths] -- --target=gs://bucket/Qwen3-4B \
        --train.data_dir="('gs://bucket/data/qwen3',)" [--train.max_steps=100 ...]

``--dry-run`` prints the gcloud commands without running them. ``--skip-create`` reuses an
existing VM. Everything after ``--`` is passed to ``dspark-jax train`` as config overrides.
Before any command runs, the config is loaded with the overrides and checked: the target
(``--target=``, a local Hugging Face folder, .gguf file or Orbax folder) and the data folders
(``--train.data_dir=``, each with the manifest.json of ``dspark-jax prepare-data``) are
required and must exist on this machine under the paths the hosts see (a shared or mounted
filesystem; relative paths start at the project root); ``--remote-paths`` checks only that
they are given. Object-store URIs (``gs://``) are passed through unchecked: every host reads the
same data and target (a local copy of the target on each) and, with ``--workdir gs://...``,
writes one set of Orbax checkpoints that a later run on any slice resumes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (ROOT, REPO_DIR, add_run_args, check_config, install_command,  # noqa: E402
                    run, split_overrides, train_command)


def main(argv=None) -> int:
    argv, overrides = split_overrides(list(sys.argv[1:] if argv is None else argv))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", required=True, help="TPU VM name")
    p.add_argument("--zone", required=True)
    p.add_argument("--accelerator", default="v5p-8", help="e.g. v5p-8, v5p-32, v6e-16")
    p.add_argument("--version", default="tpu-ubuntu2204-base", help="TPU VM software version")
    p.add_argument("--project", help="GCP project (default: gcloud's)")
    p.add_argument("--config", required=True, help="config file, relative to the project root")
    p.add_argument("--spot", action="store_true", help="create a spot VM")
    p.add_argument("--skip-create", action="store_true", help="reuse an existing VM")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    add_run_args(p)
    args = p.parse_args(argv)
    check_config(args.config, overrides, args.remote_paths, args.workdir, hosts=0)

    gcloud = ["gcloud", "compute", "tpus", "tpu-vm"]
    where = ["--zone", args.zone] + (["--project", args.project] if args.project else [])
    if not args.skip_create:
        run(gcloud + ["create", args.name, "--accelerator-type", args.accelerator,
                      "--version", args.version] + where + (["--spot"] if args.spot else []),
            args.dry_run)
    run(gcloud + ["ssh", args.name, "--worker=all", "--command", f"mkdir -p ~/{REPO_DIR}"] + where,
        args.dry_run)
    run(gcloud + ["scp", "--recurse", "--worker=all", f"{ROOT}/pyproject.toml", f"{ROOT}/README.md",
                  f"{ROOT}/dspark_jax", f"{ROOT}/configs", f"{args.name}:~/{REPO_DIR}/"] + where,
        args.dry_run)
    run(gcloud + ["ssh", args.name, "--worker=all", "--command",
                  install_command("jax[tpu]")] + where, args.dry_run)
    run(gcloud + ["ssh", args.name, "--worker=all", "--command",
                  train_command(args.config, overrides, "--distributed", args.workdir)] + where,
        args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
