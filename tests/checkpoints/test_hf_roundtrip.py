"""Export round trips: Hugging Face folder -> Target -> save_hf / save_orbax -> Target.

The export must reload bit-identically, load in transformers with the original logits, shard
with an index when asked to, and replace an existing destination atomically.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import dspark_jax  # noqa: E402
from dspark_jax.checkpoints import hf  # noqa: E402

IDS = np.random.default_rng(0).integers(3, 128, (2, 13))


def _flat(target):
    return {tuple(map(str, path)): np.asarray(var.get_value())
            for path, var in nnx.to_flat_state(target.state)}


def assert_same_params(a, b):
    fa, fb = _flat(a), _flat(b)
    assert fa.keys() == fb.keys()
    for key in fa:
        assert fa[key].dtype == fb[key].dtype, key
        assert fa[key].shape == fb[key].shape, key
        np.testing.assert_array_equal(fa[key], fb[key], err_msg=str(key))


def torch_logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)).logits.float().numpy()


def rope_type(config):
    """transformers 5 keeps it in rope_parameters, transformers 4 in rope_scaling."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if "full_attention" in rope:  # Gemma3: one rope per layer type
        return tuple(rope[t].get("rope_type") for t in sorted(rope))
    return rope.get("rope_type", rope.get("type", "default"))


def load_in_transformers(folder):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    return model.eval()


CONFIGS = {
    "llama-untied": lambda: transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2),
    "qwen3-yarn-bias-tied": lambda: transformers.Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=3, num_key_value_heads=1, head_dim=16, attention_bias=True,
        tie_word_embeddings=True, eos_token_id=[2, 5],
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8)),
    "qwen2-llama3": lambda: transformers.Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8)),
    "gemma3-sliding-linear": lambda: transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=20,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=4.0, rope_scaling=dict(rope_type="linear", factor=2.0)),
    "gemma4-global-keqv": lambda: transformers.Gemma4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=0,
        sliding_window=4, final_logit_softcapping=4.0,
        layer_types=["sliding_attention", "full_attention", "full_attention"]),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def source(request, tmp_path_factory, make_hf_checkpoint):
    folder = tmp_path_factory.mktemp("roundtrip") / request.param
    model = make_hf_checkpoint(CONFIGS[request.param](), folder, seed=3)
    return model, folder


def test_save_hf_reloads_identically(source, tmp_path):
    _, folder = source
    original = dspark_jax.load_target(folder)
    export = original.save_hf(tmp_path / "export")
    assert (export / "config.json").exists() and (export / hf.SAFETENSORS_SINGLE).exists()
    reloaded = dspark_jax.load_target(export)
    assert reloaded.config == original.config
    assert_same_params(original, reloaded)
    np.testing.assert_array_equal(reloaded.logits(IDS), original.logits(IDS))


def test_export_loads_in_transformers(source, tmp_path):
    model, folder = source
    export = dspark_jax.load_target(folder).save_hf(tmp_path / "export")
    exported = load_in_transformers(export)
    assert rope_type(exported.config) == rope_type(model.config)
    ref = torch_logits(model)
    assert np.abs(ref).max() > 0.5
    assert np.max(np.abs(torch_logits(exported) - ref)) <= 1e-5


def test_sharded_export(tiny_checkpoint, tmp_path, monkeypatch):
    model, folder = tiny_checkpoint
    original = dspark_jax.load_target(folder)
    total = sum(t.nbytes for _, t in original.torch_tensors())
    monkeypatch.setattr(hf, "write_safetensors",
                        functools.partial(hf.write_safetensors, max_shard_bytes=total // 4))
    export = original.save_hf(tmp_path / "sharded")

    index = json.loads((export / hf.SAFETENSORS_INDEX).read_text())
    shards = sorted(p.name for p in export.glob("*.safetensors"))
    assert not (export / hf.SAFETENSORS_SINGLE).exists()
    assert len(shards) >= 4
    assert sorted(set(index["weight_map"].values())) == shards
    assert index["metadata"]["total_size"] == total
    assert set(index["weight_map"]) == {k for k, _ in original.torch_tensors()}

    assert_same_params(original, dspark_jax.load_target(export))
    assert np.max(np.abs(torch_logits(load_in_transformers(export)) - torch_logits(model))) <= 1e-5


def test_save_hf_replaces_existing_folder(tiny_checkpoint, tmp_path):
    _, folder = tiny_checkpoint
    target = dspark_jax.load_target(folder)
    dest = tmp_path / "export"
    dest.mkdir()
    (dest / "stale.safetensors").write_bytes(b"stale")
    target.save_hf(dest)
    target.save_hf(dest)
    assert not (dest / "stale.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temporary leftovers
    assert_same_params(target, dspark_jax.load_target(dest))


def test_orbax_roundtrip(tiny_checkpoint, tmp_path):
    _, folder = tiny_checkpoint
    original = dspark_jax.load_target(folder)
    saved = original.save_orbax(tmp_path / "orbax")
    reloaded = dspark_jax.load_target(saved)
    assert reloaded.config == original.config
    assert_same_params(original, reloaded)
    np.testing.assert_array_equal(reloaded.logits(IDS), original.logits(IDS))
