"""The training loop end to end on a tiny random target and synthetic data: metrics, export,
resume after a real kill (SIGKILL), and two processes with jax.distributed."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest
from conftest import run_on_cpu_devices

import dspark_jax
from dspark_jax.target import init_target
from dspark_jax.training.data import write_manifest, write_shard

pytestmark = pytest.mark.slow  # training runs, kills, meshes and two processes; CI runs -m slow

TARGET = dict(architectures=["Qwen3ForCausalLM"], vocab_size=64, hidden_size=32,
              intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, eos_token_id=3)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny HF target folder, a synthetic data folder and a config file."""
    root = tmp_path_factory.mktemp("train")
    init_target(TARGET, seed=1).save_hf(root / "target")
    rng = np.random.default_rng(0)
    samples = []
    for i in range(24):
        n = int(rng.integers(20, 60))
        mask = np.zeros(n, np.int32)
        mask[n // 3:] = 1
        samples.append((i, rng.integers(4, 64, n).astype(np.int32), mask))
    (root / "data").mkdir()
    write_shard(root / "data" / "shard_00000.npz", samples)
    write_manifest(root / "data", dict(files=[dict(file="shard_00000.npz", samples=len(samples))],
                                       num_samples=len(samples)))
    config = root / "tiny.py"
    config.write_text(textwrap.dedent(f'''
        from dspark_jax import experiment

        def get_config():
            return experiment.experiment_config(
                {str(root / "target")!r},
                drafter=dict(target_layer_ids=(0, 2), mask_token_id=63, block_size=4,
                             num_layers=1, markov_rank=8, head="markov"),
                train=dict(experiment.DSPARK_TRAIN, num_anchors=4, data_dir=({str(root / "data")!r},),
                           max_steps=8, global_batch_size=2, pack_length=96,
                           anchors_per_row=8, anchor_chunk=4, learning_rate=3e-3,
                           log_every=1, checkpoint_every=1, keep_checkpoints=2,
                           heldout_dir=({str(root / "data")!r},), heldout_every=4))
    '''))
    return root, config


def losses(workdir):
    with open(workdir / "metrics.jsonl") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def run_train(config, workdir, *extra, env=None):
    return subprocess.Popen([sys.executable, "-m", "dspark_jax.cli", "train", "--config",
                             str(config), "--workdir", str(workdir), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, **(env or {})))


@pytest.fixture(scope="module")
def uninterrupted(setup):
    root, config = setup
    proc = run_train(config, root / "full")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    return root / "full"


def test_run_logs_improves_and_exports(setup, uninterrupted):
    root, _ = setup
    record = [json.loads(line) for line in open(uninterrupted / "metrics.jsonl")]
    assert [r["step"] for r in record] == list(range(1, 9))
    for key in ("loss", "ce_loss", "l1_loss", "confidence_loss", "tau_probabilistic",
                "tokens_per_s", "step_time_s", "lr"):
        assert key in record[0]
    assert record[-1]["loss"] < record[0]["loss"]
    target = dspark_jax.load_target(root / "target")
    drafter = dspark_jax.load_drafter(uninterrupted / "drafter", target)
    assert drafter.config.block_size == 4 and drafter.config.markov_rank == 8


def test_resume_after_kill_matches_uninterrupted(setup, uninterrupted):
    root, config = setup
    workdir = root / "killed"
    proc = run_train(config, workdir)
    deadline = time.time() + 600
    while time.time() < deadline:  # kill as soon as step 4 is logged
        if (workdir / "metrics.jsonl").exists() and 4 in losses(workdir):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    killed = losses(workdir)
    proc = run_train(config, workdir)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    resumed = losses(workdir)  # later lines override: steps after the restored checkpoint
    full = losses(uninterrupted)
    assert set(resumed) == set(full)
    assert max(killed) < 8
    for step in resumed:
        assert resumed[step] == full[step], (step, resumed[step], full[step])


RESUME_ON_MESH_SCRIPT = textwrap.dedent(r'''
    import contextlib
    import io
    import json
    import sys
    import jax
    from dspark_jax import cli

    assert len(jax.devices()) == 8
    rc = cli.main(["train", "--config", sys.argv[1], "--workdir", sys.argv[2],
                   "--train.mesh_shape=(1, 2, 4)"])
    with open(sys.argv[2] + "/metrics.jsonl") as f:
        report = dict(rc=rc, losses=[json.loads(line) for line in f])
    err = io.StringIO()
    with contextlib.redirect_stderr(err):  # 2 rows do not split over data x fsdp = 4
        report["bad_rc"] = cli.main(["train", "--config", sys.argv[1], "--workdir",
                                     sys.argv[2] + "_bad", "--train.mesh_shape=(2, 2, 2)"])
    report["bad_error"] = err.getvalue()
    print("REPORT " + json.dumps(report))
''')


def test_resume_onto_another_mesh(setup, uninterrupted, tmp_path):
    """A checkpoint written on one device (step 7 of 8) resumes on a (1, 2, 4) mesh of 8
    simulated devices: step 8 gives the uninterrupted run's loss and parameters. A mesh whose
    data x fsdp shards do not divide the batch is refused with a clear error."""
    root, config = setup
    workdir = tmp_path / "remeshed"
    shutil.copytree(uninterrupted / "checkpoints", workdir / "checkpoints")
    shutil.rmtree(workdir / "checkpoints" / "8")
    script = tmp_path / "resume_on_mesh.py"
    script.write_text(RESUME_ON_MESH_SCRIPT)
    report = run_on_cpu_devices([str(script), str(config), str(workdir)])
    assert report["rc"] == 0
    assert [r["step"] for r in report["losses"]] == [8]
    assert report["bad_rc"] == 2
    assert "global_batch_size 2 does not split over the 4 row shards" in report["bad_error"]
    np.testing.assert_allclose(report["losses"][0]["loss"], losses(uninterrupted)[8], rtol=1e-5)
    target = dspark_jax.load_target(root / "target")
    resumed = dspark_jax.load_drafter(workdir / "drafter", target)
    full = dspark_jax.load_drafter(uninterrupted / "drafter", target)
    for a, b in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(full.state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_run_the_same_steps(setup):
    root, config = setup
    port = _free_port()
    # One workdir for both, as on a shared filesystem: Orbax writes a checkpoint collectively.
    procs = [run_train(config, root / "mp", "--coordinator", f"localhost:{port}",
                       "--num-processes", "2", "--process-id", str(i), "--train.max_steps=3",
                       env={"JAX_PLATFORMS": "cpu"})
             for i in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    steps = losses(root / "mp")  # process 0 logs the global metrics
    assert sorted(steps) == [1, 2, 3] and all(np.isfinite(v) for v in steps.values())


def test_bfloat16_compute_on_cpu(setup, uninterrupted, tmp_path):
    """train.compute_dtype=bfloat16 runs the forward in bfloat16 on a CPU: the same batches give
    losses close to, but not equal to, the float32 run's."""
    _, config = setup
    proc = run_train(config, tmp_path / "bf16", "--train.compute_dtype=bfloat16",
                     "--train.max_steps=2", "--train.heldout_every=0")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    want, got = losses(uninterrupted), losses(tmp_path / "bf16")
    assert got[1] != want[1]
    np.testing.assert_allclose(got[1], want[1], rtol=5e-2)


def test_epochs_count_the_packed_batches(setup):
    """Without max_steps, an epoch is the batches the packing pipeline yields for one pass over
    the 24 samples (rows of 96 tokens pack several), not ceil(24 / global_batch_size)."""
    from dspark_jax.experiment import load_config
    from dspark_jax.training.pipeline import make_pipeline
    from dspark_jax.training.trainer import total_steps

    root, config_path = setup
    config = load_config(config_path)
    tcfg, dcfg = config.train, config.drafter
    data = make_pipeline(list(tcfg.data_dir), batch_size=tcfg.global_batch_size,
                         pack_length=tcfg.pack_length, anchors_per_row=tcfg.anchors_per_row,
                         anchors_per_sequence=tcfg.num_anchors, block_size=dcfg.block_size,
                         seed=tcfg.seed)
    yielded = 0
    while data.epoch == 0:  # every sample of this data has anchor candidates
        next(data)
        yielded += 1
    assert total_steps(tcfg, dcfg) == tcfg.max_steps == 8  # max_steps > 0 decides
    tcfg.max_steps, tcfg.epochs = 0, 1
    assert total_steps(tcfg, dcfg) == yielded < 24 // tcfg.global_batch_size
    tcfg.epochs = 2
    assert total_steps(tcfg, dcfg) == 2 * yielded


def test_heldout_metrics_of_the_trained_drafter(setup, uninterrupted):
    from dspark_jax.experiment import load_config
    from dspark_jax.training.heldout import heldout_metrics

    root, config_path = setup
    config = load_config(config_path)
    target = dspark_jax.load_target(root / "target")
    trained = dspark_jax.load_drafter(uninterrupted / "drafter", target)
    start = dspark_jax.init_drafter(target, config, seed=config.train.seed)
    after = heldout_metrics(trained, root / "data", config.train, progress=False)
    before = heldout_metrics(start, root / "data", config.train, progress=False)
    assert after["batches"] == before["batches"] >= 1
    assert after["valid_blocks"] == before["valid_blocks"] > 0  # the same anchors
    assert after["loss"] < before["loss"]
    assert heldout_metrics(trained, root / "data", config.train, progress=False) == after
    # The run's learning curve: steps 0, 4 and 8 on the same epoch, with W2 zeroed too.
    curve = [json.loads(line) for line in open(uninterrupted / "heldout.jsonl")]
    assert [r["step"] for r in curve] == [0, 4, 8]
    for key in ("loss", "tau_probabilistic", "valid_blocks"):
        assert curve[0][key] == pytest.approx(before[key], rel=1e-5)
        assert curve[-1][key] == pytest.approx(after[key], rel=1e-5)
    zeroed = curve[-1]["w2_zero"]
    assert zeroed["valid_blocks"] == after["valid_blocks"] and zeroed["loss"] != after["loss"]
