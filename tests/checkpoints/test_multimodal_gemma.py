"""The text model of multimodal Gemma folders (Gemma3 and Gemma4 "ForConditionalGeneration",
the 12B's Gemma4Unified): config.json nests it in ``text_config`` and its tensors sit under
``model.language_model.`` (transformers 5) or ``language_model.model.`` (Gemma3's original
checkpoints, which transformers 5 still writes for Gemma3). Logits of text-only input equal
the torch multimodal model's; the export is a text-only causal LM that reloads identically."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import dspark_jax  # noqa: E402
from dspark_jax.checkpoints.errors import CheckpointError  # noqa: E402

from conftest import randomize_torch_model  # noqa: E402

VOCAB = 300
IDS = np.random.default_rng(0).integers(3, VOCAB, (2, 13))
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
            layer_types=["sliding_attention", "full_attention", "full_attention"])
CASES = {
    # The 12B's family: full layers of another shape, keys as values, soft-capped logits.
    "gemma4-unified": lambda: transformers.Gemma4UnifiedForConditionalGeneration(
        transformers.Gemma4UnifiedConfig(
            text_config=dict(TEXT, global_head_dim=32, num_global_key_value_heads=1,
                             attention_k_eq_v=True, final_logit_softcapping=3.0),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=2, head_dim=16),
            audio_config=None)),
    "gemma3": lambda: transformers.Gemma3ForConditionalGeneration(
        transformers.Gemma3Config(
            text_config=dict(TEXT, query_pre_attn_scalar=16),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, image_size=28, patch_size=14),
            mm_tokens_per_image=4)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def folder(request, tmp_path_factory):
    torch.manual_seed(0)
    model = CASES[request.param]().float().eval()
    randomize_torch_model(model, seed=1)
    path = tmp_path_factory.mktemp("multimodal") / request.param
    model.save_pretrained(path)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(IDS)).logits.float().numpy()
    return path, ref


def test_text_model_logits_match_the_multimodal_model(folder):
    path, ref = folder
    target = dspark_jax.load_target(path)
    assert np.abs(ref).max() > 0.5
    np.testing.assert_allclose(target.logits(IDS), ref, atol=1e-4, rtol=0)
    assert dspark_jax.target.load_target_config(path) == target.config


def test_export_is_a_text_only_causal_lm(folder, tmp_path):
    path, ref = folder
    export = dspark_jax.load_target(path).save_hf(tmp_path / "text")
    reloaded = dspark_jax.load_target(export)
    assert reloaded.hf_config["architectures"][0].endswith("ForCausalLM")
    np.testing.assert_allclose(reloaded.logits(IDS), ref, atol=1e-4, rtol=0)


def test_a_folder_without_the_text_tensors_is_named(folder, tmp_path):
    import shutil

    path, _ = folder
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(path / "config.json", bare / "config.json")
    from safetensors.numpy import save_file
    save_file({"model.vision_tower.x": np.zeros(2, np.float32)}, str(bare / "model.safetensors"))
    with pytest.raises(CheckpointError, match="without its text model's tensors"):
        dspark_jax.load_target(bare)
