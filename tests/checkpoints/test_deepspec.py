"""Tests of drafter checkpoints: DeepSpec, z-lab DFlash and Orbax layouts, and bad fits."""

from __future__ import annotations

import json
import warnings

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import dspark_jax
from dspark_jax.checkpoints import deepspec, hf
from dspark_jax.checkpoints.errors import CheckpointError
from dspark_jax.model_config import model_config_from_hf
from dspark_jax.drafter_config import drafter_config
from dspark_jax.target import init_target

TINY = dict(architectures=["Qwen3ForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
QWEN3_4B = dict(architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=2560,
                intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, rope_theta=1e6, tie_word_embeddings=True)
TARGET_COPIES = ("embed_tokens.weight", "lm_head.weight")  # the deepspec layout's target tensors


def spec_shapes(*, d, heads, kv, hd, inner, vocab, taps, rank, layers, confidence=True):
    """The tensor names and torch shapes of DSPARK_SPEC.md section 10, written out by hand."""
    shapes = {"embed_tokens.weight": (vocab, d), "lm_head.weight": (vocab, d),
              "fc.weight": (d, taps * d), "hidden_norm.weight": (d,), "norm.weight": (d,)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (heads * hd, d), p + "self_attn.k_proj.weight": (kv * hd, d),
            p + "self_attn.v_proj.weight": (kv * hd, d), p + "self_attn.o_proj.weight": (d, heads * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inner, d), p + "mlp.up_proj.weight": (inner, d),
            p + "mlp.down_proj.weight": (d, inner)})
    if rank:
        shapes["markov_head.markov_w1.weight"] = (vocab, rank)
        shapes["markov_head.markov_w2.weight"] = (vocab, rank)
    if confidence:
        shapes["confidence_head.proj.weight"] = (1, d + rank)
        shapes["confidence_head.proj.bias"] = (1,)
    return shapes


@pytest.fixture(scope="module")
def target():
    return init_target(TINY, seed=0)


def _assert_same(a, b):
    assert a.config == b.config and a.model_config == b.model_config
    flat_a = {p: v.get_value() for p, v in nnx.to_flat_state(a.state)}
    flat_b = {p: v.get_value() for p, v in nnx.to_flat_state(b.state)}
    assert flat_a.keys() == flat_b.keys()
    for path in flat_a:
        np.testing.assert_array_equal(flat_a[path], flat_b[path], err_msg=str(path))


def test_qwen3_4b_names_and_shapes_without_allocation():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs" / "dspark_qwen3_4b.py"
    spec = importlib.util.spec_from_file_location("dspark_qwen3_4b", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = drafter_config(**module.get_config().drafter.to_dict())
    target_cfg = model_config_from_hf(QWEN3_4B)
    model_cfg = deepspec.draft_model_config(target_cfg, cfg.num_layers)
    _, abstract = deepspec.abstract_drafter(model_cfg, cfg, jax.numpy.bfloat16)
    assert isinstance(nnx.to_flat_state(abstract)[0][1].get_value(), jax.ShapeDtypeStruct)
    shapes = deepspec.tensor_shapes("deepspec", cfg, abstract, target_cfg)
    assert shapes == spec_shapes(d=2560, heads=32, kv=8, hd=128, inner=9728, vocab=151936, taps=5,
                                 rank=256, layers=5)
    hf_config = deepspec.hf_config_for("deepspec", model_cfg, cfg, target_cfg, num_anchors=512)
    assert hf_config["architectures"] == ["Qwen3DSparkModel"]
    assert {k: hf_config[k] for k in ("block_size", "mask_token_id", "target_layer_ids",
                                      "num_target_layers", "num_anchors", "markov_rank",
                                      "markov_head_type", "enable_confidence_head",
                                      "confidence_head_with_markov", "tie_word_embeddings",
                                      "num_hidden_layers")} == dict(
        block_size=7, mask_token_id=151669, target_layer_ids=[1, 9, 17, 25, 33],
        num_target_layers=36, num_anchors=512, markov_rank=256, markov_head_type="vanilla",
        enable_confidence_head=True, confidence_head_with_markov=True, tie_word_embeddings=False,
        num_hidden_layers=5)


@pytest.mark.parametrize("head", ["markov", "gated", "rnn", "none"])
def test_deepspec_round_trip(target, tmp_path, head):
    drafter = dspark_jax.init_drafter(target, head=head, markov_rank=8, block_size=4,
                                      mask_token_id=60, seed=4)
    folder = drafter.save(tmp_path / "d", layout="deepspec")
    tensors = load_file(str(folder / "model.safetensors"))
    expected = spec_shapes(d=32, heads=4, kv=2, hd=8, inner=64, vocab=64, taps=3,
                           rank=0 if head == "none" else 8, layers=2)
    extra = {"gated": {"markov_head.gate_proj.weight": (8, 40), "markov_head.gate_proj.bias": (8,)},
             "rnn": {"markov_head.joint_proj.weight": (24, 48), "markov_head.joint_proj.bias": (24,)}}
    expected.update(extra.get(head, {}))
    assert {k: v.shape for k, v in tensors.items()} == expected
    embed = np.asarray(target.state["embed_tokens"]["embedding"].get_value())
    np.testing.assert_array_equal(tensors["embed_tokens.weight"], embed)
    np.testing.assert_array_equal(tensors["lm_head.weight"],
                                  np.asarray(target.state["lm_head"].get_value()).T)
    config = json.loads((folder / "config.json").read_text())
    assert config["markov_head_type"] == {"gated": "gated", "rnn": "rnn"}.get(head, "vanilla")
    _assert_same(drafter, dspark_jax.load_drafter(folder, target))


def test_sharded_trainable_mask_and_orbax(target, tmp_path):
    drafter = dspark_jax.init_drafter(target, markov_rank=8, seed=5)
    assert drafter.config.trainable_mask_embedding
    folder = drafter.save(tmp_path / "single")
    tensors = load_file(str(folder / "model.safetensors"))
    np.testing.assert_array_equal(tensors["embed_tokens.weight"][drafter.config.mask_token_id],
                                  tensors["mask_embedding"])
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((folder / "config.json").read_text())
    hf.write_safetensors(tensors, sharded, max_shard_bytes=20_000)
    assert (sharded / hf.SAFETENSORS_INDEX).exists()
    _assert_same(drafter, dspark_jax.load_drafter(sharded, target))
    _assert_same(drafter, dspark_jax.load_drafter(drafter.save(tmp_path / "o", layout="orbax"), target))


def test_zlab_dflash_layout(target, tmp_path):
    drafter = dspark_jax.init_drafter(target, head="none", confidence_head=False, block_size=16,
                                      mask_token_id=62, anchor_predicts=False)
    folder = drafter.save(tmp_path / "z", layout="dflash")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"] == {"mask_token_id": 62, "target_layer_ids": [0, 1, 2]}
    keys = set(load_file(str(folder / "model.safetensors")))
    assert not any(k.startswith(("embed_tokens", "lm_head", "markov", "confidence")) for k in keys)
    loaded = dspark_jax.load_drafter(folder, target)
    _assert_same(drafter, loaded)
    assert not loaded.config.anchor_predicts
    with pytest.raises(CheckpointError, match="dflash layout has no Markov"):
        dspark_jax.init_drafter(target, markov_rank=4).save(tmp_path / "bad", layout="dflash")


@pytest.fixture(scope="module")
def saved(target, tmp_path_factory):
    drafter = dspark_jax.init_drafter(target, markov_rank=8, mask_token_id=60)
    return drafter.save(tmp_path_factory.mktemp("ck") / "d")


def _edited(saved, tmp_path, *, config=None, drop=()):
    folder = tmp_path / "edited"
    folder.mkdir()
    hf_config = json.loads((saved / "config.json").read_text())
    hf_config.update(config or {})
    (folder / "config.json").write_text(json.dumps(hf_config))
    tensors = {k: v for k, v in load_file(str(saved / "model.safetensors")).items()
               if not k.startswith(drop)}
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("change,message", [
    (dict(target=dict(hidden_size=48, head_dim=12)), "hidden size 32 does not match the target's hidden size 48"),
    (dict(target=dict(vocab_size=80)), "vocabulary size 64 does not match the target's vocabulary size 80"),
    (dict(config=dict(target_layer_ids=[0, 1, 3])), r"out of range for a target with 4 layers.*offending: \[3\]"),
    (dict(config=dict(num_target_layers=36)), "trained for a target with 36 layers"),
    (dict(drop=("markov_head.",)), "'markov' Markov head of rank 8 .* no markov_head"),
    (dict(drop=("confidence_head.",)), "enable_confidence_head.* no confidence_head"),
    (dict(drop=("layers.1.mlp.up_proj",)), "missing tensor 'layers.1.mlp.up_proj.weight'"),
])
def test_bad_fit_errors(target, saved, tmp_path, change, message):
    other = init_target({**TINY, **change["target"]}) if "target" in change else target
    folder = _edited(saved, tmp_path, config=change.get("config"), drop=change.get("drop", ()))
    with pytest.raises(CheckpointError, match=message):
        dspark_jax.load_drafter(folder, other)


def _with_tensors(saved, tmp_path, change):
    """A copy of the folder ``saved`` whose tensors went through ``change(dict) -> dict``."""
    folder = tmp_path / "changed"
    folder.mkdir()
    (folder / "config.json").write_text((saved / "config.json").read_text())
    save_file(change(load_file(str(saved / "model.safetensors"))), str(folder / "model.safetensors"))
    return folder


def _bumped(key):
    def change(tensors):
        bumped = tensors[key].copy()
        bumped[3] += 0.5
        return dict(tensors, **{key: bumped})
    return change


def _target_tensor_warnings(load) -> list[str]:
    """The warnings about differing target tensors that ``load()`` raises."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load()
    return [str(w.message) for w in caught if "differs from the target's" in str(w.message)]


def _bfloat16_copies(tensors):
    return dict(tensors, **{k: tensors[k].astype(ml_dtypes.bfloat16) for k in TARGET_COPIES})


@pytest.mark.parametrize("key", TARGET_COPIES)
def test_a_copy_of_other_target_tensors_warns(target, saved, tmp_path, key):
    folder = _with_tensors(saved, tmp_path, _bumped(key))
    name = key.removesuffix(".weight")
    with pytest.warns(UserWarning, match=rf"drafter checkpoint {folder}: its {key} differs from "
                      rf"the target's .*the drafter uses the target's {name}"):
        dspark_jax.load_drafter(folder, target)


@pytest.mark.parametrize("copies", ["float32", "bfloat16", "compact"])
def test_copies_of_the_targets_tensors_do_not_warn(target, saved, tmp_path, copies):
    change = {"float32": dict, "bfloat16": _bfloat16_copies,
              "compact": lambda t: {k: v for k, v in t.items() if k not in TARGET_COPIES}}
    folder = _with_tensors(saved, tmp_path, change[copies])
    assert not _target_tensor_warnings(lambda: dspark_jax.load_drafter(folder, target))


def test_tied_target_with_a_trainable_mask_exports_its_lm_head_unchanged(tmp_path):
    tied = init_target({**TINY, "tie_word_embeddings": True}, seed=2)
    drafter = dspark_jax.init_drafter(tied, seed=3)
    assert drafter.config.trainable_mask_embedding
    folder = drafter.save(tmp_path / "d")
    tensors = load_file(str(folder / "model.safetensors"))
    embed = np.asarray(tied.state["embed_tokens"]["embedding"].get_value())
    np.testing.assert_array_equal(tensors["lm_head.weight"], embed)
    np.testing.assert_array_equal(tensors["embed_tokens.weight"][drafter.config.mask_token_id],
                                  tensors["mask_embedding"])
    assert not _target_tensor_warnings(lambda: dspark_jax.load_drafter(folder, tied))


# A Gemma4 target whose full layers have their own shape: DeepSpec's Gemma4 drafter layers all
# take it (global head dim 16, one kv head whose keys are also the values).
GEMMA4 = dict(TINY, architectures=["Gemma4ForCausalLM"], global_head_dim=16,
              num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=0,
              sliding_window=3, final_logit_softcapping=8.0,
              layer_types=["sliding_attention", "full_attention"] * 2)


def gemma4_spec_shapes(*, d, heads, kv, hd, inner, vocab, taps, rank, layers):
    """The tensor names and torch shapes of DeepSpec's Gemma4DSparkModel
    (deepspec/modeling/dspark/gemma4/modeling.py), written out by hand: keys as values (no
    v_proj), no weight in the value norm, Gemma's four layer norms and a layer_scalar buffer."""
    shapes = spec_shapes(d=d, heads=heads, kv=kv, hd=hd, inner=inner, vocab=vocab, taps=taps,
                         rank=rank, layers=layers)
    for i in range(layers):
        p = f"layers.{i}."
        del shapes[p + "self_attn.v_proj.weight"]
        shapes.update({p + "pre_feedforward_layernorm.weight": (d,),
                       p + "post_feedforward_layernorm.weight": (d,), p + "layer_scalar": (1,)})
    return shapes


def test_gemma4_deepspec_layout(tmp_path):
    gemma4 = init_target(GEMMA4, seed=6)
    drafter = dspark_jax.init_drafter(gemma4, markov_rank=8, block_size=4, mask_token_id=60, seed=7,
                                      trainable_mask_embedding=False)
    folder = drafter.save(tmp_path / "d", layout="deepspec")
    tensors = load_file(str(folder / "model.safetensors"))
    assert {k: v.shape for k, v in tensors.items()} == gemma4_spec_shapes(
        d=32, heads=4, kv=1, hd=16, inner=64, vocab=64, taps=3, rank=8, layers=2)
    assert all(np.all(tensors[f"layers.{i}.layer_scalar"] == 1) for i in range(2))
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Gemma4DSparkModel"]
    assert (config["global_head_dim"], config["num_global_key_value_heads"],
            config["attention_k_eq_v"]) == (16, 1, True)
    assert config["layer_types"] == ["full_attention"] * 2
    _assert_same(drafter, dspark_jax.load_drafter(folder, gemma4))

    def trained_scalar(t):
        return dict(t, **{"layers.1.layer_scalar": np.full((1,), 0.5, np.float32)})

    with pytest.raises(CheckpointError, match="layers.1.layer_scalar is \\[0.5\\], not 1"):
        dspark_jax.load_drafter(_with_tensors(folder, tmp_path, trained_scalar), gemma4)


# google/gemma-4-12B-it's config.json as released (a multimodal Gemma4Unified checkpoint; the
# text model's fields as public copies of it give them), and the config.json of DeepSpec's
# published drafter deepseek-ai/dspark_gemma4_12b_block7 (its fields that matter here).
GEMMA4_12B_TEXT = dict(
    model_type="gemma4_unified_text", vocab_size=262144, hidden_size=3840, intermediate_size=15360,
    num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8,
    num_global_key_value_heads=1, head_dim=256, global_head_dim=512, attention_k_eq_v=True,
    sliding_window=1024, max_position_embeddings=262144, final_logit_softcapping=30.0,
    hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, use_bidirectional_attention="vision",
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 8,
    rope_parameters={"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6,
                                        "rope_type": "proportional"},
                     "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}})
GEMMA4_12B = dict(architectures=["Gemma4UnifiedForConditionalGeneration"], model_type="gemma4_unified",
                  tie_word_embeddings=True, text_config=GEMMA4_12B_TEXT)
DSPARK_GEMMA4_12B_BLOCK7 = dict(
    {k: v for k, v in GEMMA4_12B_TEXT.items() if k != "layer_types"},
    architectures=["Gemma4DSparkModel"], model_type="gemma4_text", num_hidden_layers=5,
    layer_types=["full_attention"] * 5, hidden_size_per_layer_input=0, enable_moe_block=False,
    num_kv_shared_layers=0, tie_word_embeddings=False, block_size=7, mask_token_id=4,
    target_layer_ids=[5, 17, 29, 41, 46], num_target_layers=48, num_anchors=512, markov_rank=256,
    markov_head_type="vanilla", enable_confidence_head=True, confidence_head_with_markov=True,
    target_model_type="gemma4_unified", target_text_model_type="gemma4_unified_text")


def test_gemma4_12b_names_and_shapes_without_allocation():
    """configs/dspark_gemma4_12b.py over the real 12B target config: DeepSpec's tensor names and
    shapes from abstract shapes only, and the published drafter's config.json reads as the same
    drafter."""
    import importlib.util
    from pathlib import Path

    from dspark_jax.model_config import text_model_hf

    path = Path(__file__).resolve().parents[2] / "configs" / "dspark_gemma4_12b.py"
    spec = importlib.util.spec_from_file_location("dspark_gemma4_12b", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = drafter_config(**module.get_config().drafter.to_dict())
    target_cfg = model_config_from_hf(text_model_hf(GEMMA4_12B))
    assert (target_cfg.num_global_key_value_heads, target_cfg.global_head_dim) == (1, 512)
    model_cfg = deepspec.draft_model_config(target_cfg, cfg.num_layers)
    _, abstract = deepspec.abstract_drafter(model_cfg, cfg, jax.numpy.bfloat16)
    assert isinstance(nnx.to_flat_state(abstract)[0][1].get_value(), jax.ShapeDtypeStruct)
    shapes = deepspec.tensor_shapes("deepspec", cfg, abstract, target_cfg)
    assert shapes == gemma4_spec_shapes(d=3840, heads=16, kv=1, hd=512, inner=15360, vocab=262144,
                                        taps=5, rank=256, layers=5)
    hf_config = deepspec.hf_config_for("deepspec", model_cfg, cfg, target_cfg, num_anchors=512)
    assert hf_config["architectures"] == ["Gemma4DSparkModel"]
    for key in ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers",
                "num_anchors", "markov_rank", "markov_head_type", "enable_confidence_head",
                "confidence_head_with_markov", "tie_word_embeddings", "num_hidden_layers",
                "layer_types", "global_head_dim", "num_global_key_value_heads", "attention_k_eq_v",
                "head_dim", "final_logit_softcapping", "hidden_size", "intermediate_size"):
        assert hf_config[key] == DSPARK_GEMMA4_12B_BLOCK7[key], key
    assert hf_config["rope_parameters"]["full_attention"] == dict(
        rope_type="proportional", partial_rotary_factor=0.25, rope_theta=1e6)
    layout, published_model_cfg, published_cfg, layers = deepspec.parse_hf_config(
        DSPARK_GEMMA4_12B_BLOCK7, target_cfg)
    assert (layout, published_cfg, layers) == ("deepspec", cfg, 48)
    assert published_model_cfg == model_cfg  # model_type gemma4_text, as DeepSpec writes it
