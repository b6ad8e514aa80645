"""The dspark-jax command line: convert round trip and error reporting."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dspark_jax import cli, load_target
from dspark_jax.checkpoints.errors import CheckpointError
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


def test_convert_a_drafter_to_a_compact_bfloat16_folder(tmp_path, capsys):
    import dspark_jax

    target = init_target(TINY, seed=5)
    target.save_hf(tmp_path / "hf")
    dspark_jax.init_drafter(target, seed=1, num_layers=1).save(tmp_path / "d", num_anchors=64)
    assert cli.main(["convert", "--model", str(tmp_path / "hf"), "--drafter", str(tmp_path / "d"),
                     "--to", "deepspec", "--dtype", "bfloat16", "--compact",
                     "--output", str(tmp_path / "small")]) == 0
    loaded = dspark_jax.load_drafter(tmp_path / "small", load_target(tmp_path / "hf"))
    assert loaded.config.num_layers == 1
    assert json.loads((tmp_path / "small" / "config.json").read_text())["num_anchors"] == 64
    assert (tmp_path / "small" / "model.safetensors").stat().st_size < 0.5 * (
        tmp_path / "d" / "model.safetensors").stat().st_size
    assert cli.main(["convert", "--model", str(tmp_path / "hf"), "--drafter", str(tmp_path / "d"),
                     "--to", "gguf", "--output", str(tmp_path / "x.gguf")]) == 2
    assert "a drafter converts to deepspec, dflash or orbax" in capsys.readouterr().err


def test_unknown_model_is_a_clear_error(capsys):
    assert cli.main(["generate", "--model", "no-such-model", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no-such-model'" in err and "smollm2-135m-instruct" in err


@pytest.mark.slow  # the real SmolLM2, three generate programs; CI runs -m slow
def test_generate_with_an_untrained_drafter(smollm2, smollm2_cache, monkeypatch, capsys,
                                            tmp_path):
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(smollm2_cache))
    assert cli.main(["generate", "--prompt", "Count to five.", "--max-new-tokens", "12",
                     "--drafter", "init", "--verify", "threshold", "--threshold", "0.4"]) == 0
    out = capsys.readouterr().out
    assert ">>> Count to five." in out and "tau " in out and "accept rate @k" in out
    # A steps/s table from a file: one forward token costs half of two, so prefix verifies
    # nothing (mean proposal 0), where a flat table would verify every draft.
    table = tmp_path / "sps.json"
    table.write_text(json.dumps({"table": [1.0, 1.0] + [0.5] * 7}))
    assert cli.main(["generate", "--prompt", "Count to five.", "--max-new-tokens", "12",
                     "--drafter", "init", "--verify", "prefix", "--sps", str(table)]) == 0
    assert "mean proposal 0.00" in capsys.readouterr().out
    assert cli.main(["generate", "--prompt", "hi", "--drafter", "init", "--verify", "prefix",
                     "--sps", str(tmp_path / "missing.json")]) == 2
    assert "missing.json: no such file" in capsys.readouterr().err


def test_an_sps_file_is_read_as_a_table_or_as_a_profile(tmp_path):
    """A list is the table; a profile-sps JSON gives the table of its samples, settled (a
    profile written before settling carried its raw medians' table)."""
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps([1.0, 1.0, 0.5]))
    assert cli._load_sps_file(str(listed)) == [1.0, 1.0, 0.5]
    samples = [[0.010, 0.011, 0.012], [0.0105, 0.0112, 0.0121], [0.030, 0.031, 0.029]]
    profile = dict(key={}, grid=[1, 2, 4], seconds=[0.011, 0.0112, 0.030], samples=samples,
                   created=0.0, table=[91.0, 91.0, 89.0, 33.0, 33.0])
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    table = cli._load_sps_file(str(tmp_path / "profile.json"))
    np.testing.assert_allclose(table, [1 / 0.0111] * 3 + [1 / 0.030] * 2, rtol=1e-6)


def test_a_programming_error_is_not_reported_as_bad_input(monkeypatch):
    def buggy(args):
        raise TypeError("unsupported operand type(s) for +: 'int' and 'str'")

    monkeypatch.setattr(cli, "cmd_convert", buggy)
    with pytest.raises(TypeError, match="unsupported operand"):
        cli.main(["convert", "--to", "hf", "--output", "unused"])


def test_checkpoint_errors_are_reported_as_bad_input(monkeypatch, capsys):
    def missing(args):
        raise CheckpointError("no safetensors weights in /nowhere")

    monkeypatch.setattr(cli, "cmd_convert", missing)
    assert cli.main(["convert", "--to", "hf", "--output", "unused"]) == 2
    assert "dspark-jax convert: error: no safetensors weights in /nowhere" in capsys.readouterr().err


def test_no_pytorch_notice_without_torch():
    """transformers says "PyTorch was not found" when it is first imported without torch;
    dspark-jax only uses its tokenizers, so the notice is dropped, and only that one."""
    script = ("import sys; sys.modules['torch'] = None\n"  # torch unimportable
              "import dspark_jax\n"
              "from transformers import PreTrainedTokenizerFast\n"  # what the tokenizers import
              "from transformers.utils import logging\n"
              "logging.get_logger('transformers').warning('another transformers warning')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "PyTorch was not found" not in proc.stdout + proc.stderr
    assert "another transformers warning" in proc.stderr


def test_training_commands_name_missing_inputs(tmp_path, capsys):
    """A Qwen3 config leaves the target and the data to the user: both commands say what to
    pass before loading anything."""
    config = str(Path(__file__).parents[1] / "configs" / "dspark_qwen3_4b.py")
    assert cli.main(["prepare-features", "--config", config, "--data",
                     str(tmp_path), "--output", str(tmp_path / "f")]) == 2
    assert "names no target: pass --target PATH" in capsys.readouterr().err
    assert cli.main(["train", "--config", config,
                     "--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert "target is required" in err and "train.data_dir is required" in err


def test_missing_data_folder_is_one_line(smollm2, tmp_path, capsys):
    """A data folder without a manifest: exit status 2 and the message, no traceback."""
    config = str(Path(__file__).parents[1] / "configs" / "dspark_smollm2_135m.py")
    assert cli.main(["prepare-features", "--config", config, "--data", str(tmp_path),
                     "--output", str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err
    assert f"dspark-jax prepare-features: error: no manifest.json in {tmp_path}" in err
    assert "Traceback" not in err


def _prepared_folder(path: Path, answers: list[list[int]], vocab_size: int = 40) -> None:
    """A prepared data folder (training/data.py format) whose samples are a 2-token prompt
    and the given answer tokens."""
    from dspark_jax.training import data

    path.mkdir(parents=True)
    samples = [(i, np.asarray([1, 2] + a, np.int32), np.asarray([0, 0] + [1] * len(a), np.uint8))
               for i, a in enumerate(answers)]
    data.write_shard(path / "shard_00000.npz", samples)
    data.write_manifest(path, dict(format=data.FORMAT, settings=dict(vocab_size=vocab_size),
                                   files=[dict(file="shard_00000.npz")]))


def test_draft_vocab_writes_the_most_frequent_answer_tokens(tmp_path, capsys):
    """`draft-vocab` counts answer tokens only (the prompt tokens 1, 2 are the most frequent
    overall), writes draft_vocab.json, and load_drafter restricts the drafter with it; a
    saved drafter carries it; a corrupt file is a checkpoint error that names it."""
    import dspark_jax

    target = init_target(TINY, seed=5)
    dspark_jax.init_drafter(target, seed=1, num_layers=1).save(tmp_path / "d")
    _prepared_folder(tmp_path / "train", [[7, 7, 9, 30], [7, 9, 11], [30, 9, 3]])
    _prepared_folder(tmp_path / "held", [[7, 9, 12, 13]])
    assert cli.main(["draft-vocab", "--drafter", str(tmp_path / "d"), "--data",
                     str(tmp_path / "train"), "--size", "3", "--heldout", str(tmp_path / "held")]) == 0
    assert "cover 80.00% of the data's answer tokens, 50.00% of the held-out's" in capsys.readouterr().out
    written = json.loads((tmp_path / "d" / "draft_vocab.json").read_text())
    assert written["token_ids"] == [7, 9, 30] and written["source"]["distinct_tokens"] == 5
    drafter = dspark_jax.load_drafter(tmp_path / "d", target)
    np.testing.assert_array_equal(drafter.draft_vocab, [7, 9, 30])
    assert "draft vocabulary 3" in repr(drafter)
    drafter.save(tmp_path / "copy")
    np.testing.assert_array_equal(dspark_jax.load_drafter(tmp_path / "copy", target).draft_vocab,
                                  [7, 9, 30])

    with pytest.raises(ValueError, match=r"must lie in \[0, 40\)"):
        drafter.restrict_vocab([3, 40])
    with pytest.raises(ValueError, match="must be distinct; repeated: \\[5\\]"):
        drafter.restrict_vocab([5, 5, 6])
    drafter.restrict_vocab(None)
    assert drafter.draft_vocab is None
    (tmp_path / "d" / "draft_vocab.json").write_text('{"token_ids": [1, 99]}')
    with pytest.raises(CheckpointError, match="corrupt draft_vocab.json .* must lie in"):
        dspark_jax.load_drafter(tmp_path / "d", target)
    assert cli.main(["draft-vocab", "--drafter", str(tmp_path / "d"), "--data",
                     str(tmp_path / "train"), "--size", "41"]) == 2
    assert "a draft vocabulary of 41 tokens out of a vocabulary of 40" in capsys.readouterr().err


def test_sps_auto_profiles_the_engine_that_decodes(monkeypatch):
    """`generate --sps auto` measures the steps/s of the engine it then decodes with: the same
    sampling and weight dtypes (a bfloat16 engine's verify costs are another curve), through an
    Engine built with them."""
    from types import SimpleNamespace

    import dspark_jax.prompts as prompts_lib
    from dspark_jax.engine import engine as engine_lib

    seen = {}

    class FakeEngine:
        def __init__(self, target, drafter, **kwargs):
            seen["engine"] = kwargs

        def profile_sps(self, **sampling):
            seen["sampling"] = sampling
            return SimpleNamespace(table=lambda: [1.0, 0.9])

    monkeypatch.setattr(engine_lib, "Engine", FakeEngine)
    monkeypatch.setattr(prompts_lib, "encode_prompts", lambda target, prompts: [[1, 2, 3]] * len(prompts))
    args = SimpleNamespace(sps="auto", max_new_tokens=8, temperature=0.5, top_p=0.9, top_k=4,
                           weight_dtype="bfloat16", draft_weight_dtype="bfloat16")
    drafter = SimpleNamespace(num_proposals=6)
    assert cli._sps_table(args, "target", drafter, ["p", "q"]) == [1.0, 0.9]
    assert seen["engine"] == dict(slots=2, max_len=256, weight_dtype="bfloat16",
                                  draft_weight_dtype="bfloat16")
    assert seen["sampling"] == dict(temperature=0.5, top_p=0.9, top_k=4)
