"""The launch scripts print what they would run (--dry-run) and run nothing."""

import subprocess
import sys
from pathlib import Path

LAUNCH = Path(__file__).resolve().parents[2] / "launch"


def dry_run(script, *args):
    proc = subprocess.run([sys.executable, str(LAUNCH / script), "--dry-run", *args],
                          capture_output=True, text=True, timeout=60, env={"PATH": "/nonexistent"})
    assert proc.returncode == 0, proc.stderr
    return [line[2:] for line in proc.stdout.splitlines() if line.startswith("+ ")]


def test_tpu_pod_dry_run():
    cmds = dry_run("tpu_pod.py", "--name", "dspark", "--zone", "us-east5-a", "--accelerator",
                   "v5p-32", "--config", "configs/dspark_qwen3_4b.py")
    assert cmds[0].startswith("gcloud compute tpus tpu-vm create dspark --accelerator-type v5p-32")
    assert any("scp --recurse --worker=all" in c for c in cmds)
    assert any("jax[tpu]" in c for c in cmds)
    assert "dspark-jax train --config configs/dspark_qwen3_4b.py --distributed" in cmds[-1]
    assert "--worker=all" in cmds[-1]


def test_tpu_pod_overrides_and_reuse():
    cmds = dry_run("tpu_pod.py", "--name", "d", "--zone", "z", "--config", "c.py", "--skip-create",
                   "--", "--train.max_steps=10")
    assert not any(" create " in c for c in cmds)
    assert "--distributed --train.max_steps=10" in cmds[-1]


def test_gpu_multihost_dry_run():
    cmds = dry_run("gpu_multihost.py", "--hosts", "gpu0,user@gpu1", "--config", "c.py",
                   "--port", "2222")
    trains = [c for c in cmds if "dspark-jax train" in c]
    assert len(trains) == 2
    for i, c in enumerate(trains):
        assert "--coordinator gpu0:2222 --num-processes 2" in c and f"--process-id {i}" in c
    assert sum(c.startswith("rsync") for c in cmds) == 2
