"""The dspark-jax command line: convert round trip and error reporting."""

import numpy as np

from dspark_jax import cli, load_target
from dspark_jax.target import init_target

TINY = dict(architectures=["Qwen3ForCausalLM"], vocab_size=40, hidden_size=32, intermediate_size=48,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def test_convert_hf_to_orbax_and_back(tmp_path):
    source = init_target(TINY, seed=5)
    source.save_hf(tmp_path / "hf")
    assert cli.main(["convert", "--model", str(tmp_path / "hf"), "--to", "orbax",
                     "--output", str(tmp_path / "orbax")]) == 0
    assert cli.main(["convert", "--model", str(tmp_path / "orbax"), "--to", "hf",
                     "--output", str(tmp_path / "hf2")]) == 0
    ids = np.array([[1, 5, 9, 30]])
    np.testing.assert_array_equal(load_target(tmp_path / "hf2").logits(ids), source.logits(ids))


def test_unknown_model_is_a_clear_error(capsys):
    assert cli.main(["generate", "--model", "no-such-model", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no-such-model'" in err and "smollm2-135m-instruct" in err


def test_generate_with_an_untrained_drafter(smollm2, smollm2_cache, monkeypatch, capsys):
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(smollm2_cache))
    assert cli.main(["generate", "--prompt", "Count to five.", "--max-new-tokens", "12",
                     "--drafter", "init", "--verify", "threshold", "--threshold", "0.4"]) == 0
    out = capsys.readouterr().out
    assert ">>> Count to five." in out and "tau " in out and "accept rate @k" in out
