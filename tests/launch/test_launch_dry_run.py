"""The launch scripts check the config, print what they would run (--dry-run) and run nothing."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_jax.target import init_target

LAUNCH = Path(__file__).resolve().parents[2] / "launch"
# A small Qwen3 target; the Qwen3 configs' taps (up to 33) and mask (151669) do not fit it, so
# the runs that use it pass drafter overrides that do.
TINY_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], vocab_size=64, hidden_size=32,
                  intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8)
FITTING_DRAFTER = ("--drafter.target_layer_ids=(0, 1, 2)", "--drafter.mask_token_id=60")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """{"target": a Hugging Face folder of TINY_QWEN3, "data": a prepare-data folder}."""
    root = tmp_path_factory.mktemp("inputs")
    init_target(TINY_QWEN3, seed=0).save_hf(root / "qwen3")
    (root / "data").mkdir()
    (root / "data" / "manifest.json").write_text(json.dumps(
        dict(format="dspark-jax-tokens-v1", files=[], num_samples=0, prompts_done=0)))
    return dict(target=str(root / "qwen3"), data=str(root / "data"))


def launch(script, *args):
    return subprocess.run([sys.executable, str(LAUNCH / script), "--dry-run", *args],
                          capture_output=True, text=True, timeout=120, env={"PATH": "/nonexistent"})


def dry_run(script, *args):
    proc = launch(script, *args)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, [line[2:] for line in proc.stdout.splitlines() if line.startswith("+ ")]


def qwen3_overrides(inputs):
    return ("--", f"--target={inputs['target']}", f"--train.data_dir=('{inputs['data']}',)",
            *FITTING_DRAFTER)


def test_tpu_pod_dry_run(inputs):
    out, cmds = dry_run("tpu_pod.py", "--name", "dspark", "--zone", "us-east5-a", "--accelerator",
                        "v5p-32", "--config", "configs/dspark_qwen3_4b.py", *qwen3_overrides(inputs))
    assert f"target {inputs['target']}: qwen3, 4 layers, hidden size 32, vocabulary 64" in out
    assert cmds[0].startswith("gcloud compute tpus tpu-vm create dspark --accelerator-type v5p-32")
    assert any("scp --recurse --worker=all" in c for c in cmds)
    assert any("jax[tpu]" in c for c in cmds)
    assert "dspark-jax train --config configs/dspark_qwen3_4b.py --distributed" in cmds[-1]
    assert f"--target={inputs['target']}" in cmds[-1]
    assert "--worker=all" in cmds[-1]


def test_tpu_pod_overrides_and_reuse(inputs):
    out, cmds = dry_run("tpu_pod.py", "--name", "d", "--zone", "z", "--skip-create", "--config",
                        "configs/dspark_smollm2_135m.py", "--", "--train.max_steps=10",
                        f"--train.data_dir=('{inputs['data']}',)")
    assert "target smollm2-135m-instruct: registered" in out
    assert not any(" create " in c for c in cmds)
    assert "--distributed --train.max_steps=10" in cmds[-1]


def test_gpu_multihost_dry_run(inputs):
    _, cmds = dry_run("gpu_multihost.py", "--hosts", "gpu0,user@gpu1", "--config",
                      "configs/dflash_smollm2_135m.py", "--port", "2222", "--",
                      f"--train.data_dir=('{inputs['data']}',)")
    trains = [c for c in cmds if "dspark-jax train" in c]
    assert len(trains) == 2
    for i, c in enumerate(trains):
        assert "--coordinator gpu0:2222 --num-processes 2" in c and f"--process-id {i}" in c
    assert sum(c.startswith("rsync") for c in cmds) == 2


@pytest.mark.parametrize("script,extra", [
    ("tpu_pod.py", ("--name", "d", "--zone", "z")),
    ("gpu_multihost.py", ("--hosts", "gpu0")),
])
def test_required_overrides_are_checked_before_any_host_starts(script, extra):
    proc = launch(script, *extra, "--config", "configs/dspark_qwen3_4b.py")
    assert proc.returncode != 0
    assert ("configs/dspark_qwen3_4b.py: target is required: a local Hugging Face folder, .gguf "
            "file or Orbax folder") in proc.stderr and "(pass --target=PATH)" in proc.stderr
    assert "configs/dspark_qwen3_4b.py: train.data_dir is required" in proc.stderr
    assert "+ " not in proc.stdout


@pytest.mark.parametrize("overrides,message", [
    (lambda d: ("--target=Qwen/Qwen3-4B", f"--train.data_dir=('{d['data']}',)", *FITTING_DRAFTER),
     "target 'Qwen/Qwen3-4B' does not exist"),
    (lambda d: (f"--target={d['target']}", f"--train.data_dir=('{d['target']}',)",
                *FITTING_DRAFTER),  # a folder without manifest.json
     r"train.data_dir folder \S+qwen3 holds no manifest.json: run `dspark-jax prepare-data"),
    (lambda d: (f"--target={d['target']}", f"--train.data_dir=('{d['data']}',)"),
     r"the drafter does not fit the target \S+qwen3: target_layer_ids \[1, 9, 17, 25, 33\] "
     r"out of range for a target with 4 layers"),
])
def test_a_target_or_data_that_is_not_there_is_an_error(inputs, overrides, message):
    proc = launch("gpu_multihost.py", "--hosts", "gpu0", "--config", "configs/dspark_qwen3_4b.py",
                  "--", *overrides(inputs))
    assert proc.returncode != 0 and "+ " not in proc.stdout
    assert re.search(message, proc.stderr), proc.stderr


def test_remote_paths_are_only_required(inputs):
    out, cmds = dry_run("tpu_pod.py", "--name", "d", "--zone", "z", "--remote-paths", "--config",
                        "configs/dspark_qwen3_4b.py", "--", "--target=/mnt/models/Qwen3-4B",
                        "--train.data_dir=('/mnt/data/qwen3',)")
    assert "target /mnt/models/Qwen3-4B: not checked here (--remote-paths)" in out
    assert "--target=/mnt/models/Qwen3-4B" in cmds[-1]


@pytest.mark.parametrize("script,extra", [
    ("tpu_pod.py", ("--name", "d", "--zone", "z")),
    ("gpu_multihost.py", ("--hosts", "gpu0,gpu1")),
])
def test_object_store_paths_pass_through_to_every_host(script, extra):
    out, cmds = dry_run(script, *extra, "--config", "configs/dspark_qwen3_4b.py",
                        "--workdir", "gs://bucket/runs/qwen3", "--",
                        "--target=gs://bucket/models/Qwen3-4B",
                        "--train.data_dir=('gs://bucket/data/math','gs://bucket/data/chat')",
                        "--train.feature_dir=('gs://bucket/features/math','gs://bucket/features/chat')")
    assert "target gs://bucket/models/Qwen3-4B: on the object store, read by the hosts" in out
    assert "train.data_dir gs://bucket/data/chat: on the object store, read by the hosts" in out
    assert "train.feature_dir gs://bucket/features/math: on the object store" in out
    assert "workdir gs://bucket/runs/qwen3: on the object store, written by the hosts" in out
    trains = [c for c in cmds if "dspark-jax train" in c]
    assert trains and all("--workdir gs://bucket/runs/qwen3" in c for c in trains)
    assert any("pip install -q -e" in c and ".[gcs]" in c for c in cmds)  # gcsfs on every host
    assert all("--target=gs://bucket/models/Qwen3-4B" in c and "gs://bucket/features/chat" in c
               for c in trains)


@pytest.mark.parametrize("script,extra,told", [
    ("gpu_multihost.py", ("--hosts", "gpu0,gpu1"), True),
    ("tpu_pod.py", ("--name", "d", "--zone", "z"), True),  # a slice: its hosts are not known here
    ("gpu_multihost.py", ("--hosts", "gpu0"), False),
])
def test_several_hosts_without_a_shared_workdir_are_told(inputs, script, extra, told):
    out, _ = dry_run(script, *extra, "--config", "configs/dflash_smollm2_135m.py", "--",
                     f"--train.data_dir=('{inputs['data']}',)")
    assert "workdir runs/dflash_smollm2_135m on every host" in out
    assert ("(each host its own: pass --workdir gs://... for one set of checkpoints)" in out) == told
