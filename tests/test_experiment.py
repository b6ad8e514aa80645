"""Config files and dotted command-line overrides."""

from pathlib import Path

import pytest

from dspark_jax.experiment import apply_overrides, load_config

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
