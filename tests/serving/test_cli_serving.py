"""The profile-sps and serve-bench subcommands on a tiny checkpoint."""

import json

import pytest

from dspark_jax import cli
from dspark_jax.engine.engine import sampling_mode
from dspark_jax.target import init_target

TINY = dict(architectures=["Qwen3ForCausalLM"], vocab_size=40, hidden_size=32, intermediate_size=48,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


@pytest.mark.slow  # a profile run; CI runs -m slow
def test_profile_sps_writes_table_and_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(tmp_path / "cache"))
    init_target(TINY, seed=5).save_hf(tmp_path / "hf")
    assert cli.main(["profile-sps", "--model", str(tmp_path / "hf"), "--drafter", "init",
                     "--slots", "1", "--max-len", "32", "--buckets", "2", "--repeats", "2",
                     "--warmup", "1", "--plot", str(tmp_path / "sps.png")]) == 0
    out = capsys.readouterr().out
    assert "B =     2 tokens" in out and "B =     8 tokens" in out
    saved = json.loads(next((tmp_path / "cache" / "sps").glob("*.json")).read_text())
    assert saved["grid"] == [2, 8] and len(saved["table"]) == 9 and saved["key"]["slots"] == 1
    assert saved["key"]["sampling"] == "sampled"  # --temperature 1 by default, as serve-bench
    assert (tmp_path / "sps.png").read_bytes()[:4] == b"\x89PNG"


def test_sampling_mode_keys_the_profile():
    assert sampling_mode(0.0, 0.9, 20) == "greedy"
    assert sampling_mode(1.0, 1.0, 0) == "sampled"
    assert sampling_mode(0.7, 0.8, 0) == sampling_mode(1.0, 1.0, 20) == "sampled-truncated"


def test_serve_bench_needs_text_prompts(tmp_path, capsys):
    init_target(TINY, seed=5).save_hf(tmp_path / "hf")
    assert cli.main(["serve-bench", "--model", str(tmp_path / "hf"), "--drafter", "init",
                     "--prompts", "2"]) == 2
    assert "no tokenizer" in capsys.readouterr().err


class _EngineBuilt(Exception):
    """Raised by the fake engine below once it has recorded its arguments."""


@pytest.mark.parametrize("command", [["profile-sps"], ["serve-bench"], ["serve"]])
def test_serving_commands_build_the_engine_in_the_weight_dtypes(command, monkeypatch):
    """`--weight-dtype` / `--draft-weight-dtype` reach the Engine that profile-sps, serve-bench
    and serve decode with (each built its engine without them before)."""
    from types import SimpleNamespace

    import dspark_jax
    import dspark_jax.engine
    from dspark_jax.serving import bench, loadgen

    seen = {}

    def fake_engine(target, drafter, **kwargs):
        seen.update(kwargs)
        raise _EngineBuilt

    target = SimpleNamespace(tokenizer=object())
    monkeypatch.setattr(dspark_jax, "load_target", lambda *args, **kwargs: target)
    monkeypatch.setattr(dspark_jax, "load_drafter",
                        lambda *args, **kwargs: SimpleNamespace(num_proposals=6))
    monkeypatch.setattr(dspark_jax.engine, "Engine", fake_engine)
    monkeypatch.setattr(bench, "Engine", fake_engine)
    monkeypatch.setattr(loadgen, "eval_prompts", lambda *args, **kwargs: [[1, 2, 3]])
    with pytest.raises(_EngineBuilt):
        cli.main(command + ["--drafter", "d", "--weight-dtype", "bfloat16",
                            "--draft-weight-dtype", "bfloat16"])
    assert seen["weight_dtype"] == seen["draft_weight_dtype"] == "bfloat16"
