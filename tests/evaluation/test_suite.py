"""The acceptance benchmark runner: benchmark files, caps, resumability, report == generate."""

import json
import random

import numpy as np
import pytest

import dspark_jax
from dspark_jax import cli
from dspark_jax.drafter import Drafter
from dspark_jax.evaluation import AcceptanceTrace, suite
from dspark_jax import prompts
from dspark_jax.engine.stats import stats_from_counters, sum_counters
from dspark_jax.prompts import prompt_bucket
from dspark_jax.target import init_target

CONFIG = dict(architectures=["Qwen3ForCausalLM"], vocab_size=48, hidden_size=32,
              intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, eos_token_id=3, max_position_embeddings=512)
PROMPTS = [[5, 9, 11, 7], [4, 8, 15, 16, 23], [17], [6, 6, 7], [30, 31]]


@pytest.fixture(scope="module")
def pair():
    target = init_target(CONFIG, seed=1)
    return target, dspark_jax.init_drafter(target, seed=2)


def test_load_benchmark_caps_with_the_seeded_shuffle(tmp_path):
    lines = [json.dumps({"turns": [f"q{i}", "second turn"]}) for i in range(40)]
    (tmp_path / "aime25.jsonl").write_text("\n".join(lines) + "\n")
    expected = [f"q{i}" for i in range(40)]
    random.Random(prompts.EVAL_SEED).shuffle(expected)
    assert prompts.load_benchmark("aime25", tmp_path) == expected[:30]  # cap 30
    assert prompts.load_benchmark("aime25", tmp_path, limit=5) == expected[:5]
    (tmp_path / "mt-bench.jsonl").write_text('{"turns": ["a", "b"]}\n{"turns": ["c"]}\n')
    assert prompts.load_benchmark("mt-bench", tmp_path) == ["a", "c"]  # under the cap: in order
    with pytest.raises(ValueError, match="unknown benchmark 'gsm9k'"):
        prompts.load_benchmark("gsm9k", tmp_path)
    with pytest.raises(ValueError, match="humaneval.jsonl not found"):
        prompts.load_benchmark("humaneval", tmp_path)
    (tmp_path / "mbpp.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="mbpp.jsonl:1"):
        prompts.load_benchmark("mbpp", tmp_path)
    # A line separator inside a JSON string does not end the line; a broken line is named.
    (tmp_path / "alpaca.jsonl").write_text(json.dumps({"turns": ["a\u2028b"]}, ensure_ascii=False)
                                           + "\n", encoding="utf-8")
    assert prompts.load_benchmark("alpaca", tmp_path) == ["a\u2028b"]
    (tmp_path / "alpaca.jsonl").write_text('{"turns": ["a"]}\n{"turns": ["b\n', encoding="utf-8")
    with pytest.raises(ValueError, match="alpaca.jsonl:2: not a JSON object"):
        prompts.load_benchmark("alpaca", tmp_path)


def test_plan_batches():
    assert suite.plan_batches([5, 1, 9, 2, 7], 2) == [[0, 1], [2, 3], [4]]
    width = prompt_bucket(1)  # every length below is within the smallest bucket ...
    lengths = [3, 1, 2, 1, 4 * width + 1, 2]  # ... but one prompt needs 8 of them
    assert suite.plan_batches(lengths, 3, max_batch_tokens=2 * width) == [
        [1, 3], [2, 5], [0], [4]]  # sorted (stable); two rows fit the budget; too long: alone
    assert suite.plan_batches(lengths, 4, max_batch_tokens=16 * width) == [[1, 3, 2, 5], [0, 4]]
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        suite.plan_batches(lengths, 0)
    with pytest.raises(ValueError, match="max_batch_tokens must be >= 1"):
        suite.plan_batches(lengths, 2, max_batch_tokens=0)


@pytest.mark.slow  # the whole eval loop over two batch plans
@pytest.mark.parametrize("max_batch_tokens", [None, 2 * prompt_bucket(1)])
def test_report_equals_the_statistics_of_generate(pair, max_batch_tokens):
    target, drafter = pair
    temperature = 1.0  # sampled: the seeds per batch must match too
    stats, trace = suite.run_benchmark(target, drafter, PROMPTS, max_new_tokens=16,
                                       temperature=temperature, batch_size=2, seed=7,
                                       max_batch_tokens=max_batch_tokens, progress=False)
    counters, rounds, done = [], 0, 0
    for batch in suite.plan_batches([len(p) for p in PROMPTS], 2, max_batch_tokens):
        for r in dspark_jax.generate(target, [PROMPTS[i] for i in batch], max_new_tokens=16,
                                     temperature=temperature, seed=7 + done, drafter=drafter,
                                     record=True):  # run_benchmark's compiled programs
            counters.append(r.stats["counters"])
            rounds += r.stats["rounds"]
        done += len(batch)
    direct = stats_from_counters(sum_counters(counters))
    for key in ("tau", "rounds", "accepted", "proposal_len", "verify_rate", "accept_rate_at_k",
                "conditional_acceptance", "counters"):
        assert stats[key] == direct[key], key
    assert trace.num_rounds == rounds and stats["num_prompts"] == len(PROMPTS)
    assert sorted(set(trace.request_ids.tolist())) == list(range(len(PROMPTS)))
    assert int(trace.num_accepted.sum()) == stats["accepted"]


@pytest.mark.slow  # with the eval loop end to end
def test_evaluate_is_resumable_and_writes_the_table(pair, tmp_path, monkeypatch, capsys):
    target, drafter = pair
    data = tmp_path / "data"
    data.mkdir()
    for name in ("gsm8k", "mt-bench"):
        (data / f"{name}.jsonl").write_text("".join(
            json.dumps({"turns": [f"{name} {i}"]}) + "\n" for i in range(3)))
    monkeypatch.setattr(suite, "load_benchmark", lambda name, data_dir, limit: PROMPTS[:limit])
    settings = dict(max_new_tokens=8, batch_size=4)
    report = suite.evaluate(target, {"dspark": drafter, "other": drafter}, ["gsm8k", "mt-bench"],
                            tmp_path / "out", data_dir=data, limit=3, progress=False, **settings)
    assert set(report["results"]) == {"dspark", "other"}
    trace = AcceptanceTrace.load(tmp_path / "out" / "dspark" / "gsm8k.npz")
    assert trace.num_rounds == report["results"]["dspark"]["gsm8k"]["rounds"]
    table = (tmp_path / "out" / "report.md").read_text()
    assert "| dspark |" in table and "mean math" in table and "mean chat" in table

    def fail(*args, **kwargs):
        raise AssertionError("a finished benchmark ran again")

    monkeypatch.setattr(suite, "run_benchmark", fail)
    again = suite.evaluate(target, {"dspark": drafter}, ["gsm8k"], tmp_path / "out",
                           data_dir=data, limit=3, progress=False, max_batch_tokens=None,
                           **settings)  # no token budget is the setting results had before it
    assert again["results"]["dspark"]["gsm8k"] == report["results"]["dspark"]["gsm8k"]
    collected = suite.write_report(tmp_path / "out", ["dspark", "other"], ["gsm8k", "mt-bench"])
    assert collected["results"] == report["results"]
    identity = dict(drafter_sha256=suite.params_sha256(drafter.state),
                    target_sha256=suite.params_sha256(target.state))
    assert collected["settings"]["runs"]["other"]["mt-bench"] == dict(settings, limit=3,
                                                                      **identity)
    with pytest.raises(ValueError, match="no finished result for 'dspark' on 'alpaca'"):
        suite.write_report(tmp_path / "out", ["dspark"], ["alpaca"])
    (tmp_path / "out" / "report.md").unlink()
    args = ["eval", "--drafter", "unused", "--drafter", "unused", "--label", "dspark", "--label",
            "other", "--output", str(tmp_path / "out"), "--report-only"]
    assert cli.main(args + ["--bench", "gsm8k,mt-bench"]) == 0  # loads no model
    assert (tmp_path / "out" / "report.md").read_text() == table
    assert cli.main(args + ["--bench", "gsm8k,alpaca"]) == 2
    assert "no finished result for 'dspark' on 'alpaca'" in capsys.readouterr().err


def test_params_sha256_names_every_leaf(pair):
    target, drafter = pair
    digest = suite.params_sha256(drafter.state)
    assert digest == suite.params_sha256(drafter.state) != suite.params_sha256(target.state)
    tree = dict(a=np.ones((2, 3), np.float32), b=np.float32(2))
    assert suite.params_sha256(tree) == suite.params_sha256(dict(b=tree["b"], a=tree["a"]))
    for changed in (dict(tree, a=tree["a"].reshape(3, 2)), dict(a=tree["a"], c=tree["b"]),
                    dict(tree, a=tree["a"].astype(np.float16)), dict(tree, b=np.float32(3))):
        assert suite.params_sha256(changed) != suite.params_sha256(tree)


@pytest.mark.slow  # three eval runs
def test_resume_redoes_results_of_another_drafter_or_target(pair, tmp_path, monkeypatch,
                                                            capsys):
    """A finished result is reused only for the same drafter and target parameters; results of
    another drafter, another target or older code (no identity recorded) are recomputed."""
    target, drafter = pair
    monkeypatch.setattr(suite, "load_benchmark", lambda name, data_dir, limit: PROMPTS[:limit])
    runs = []
    real_run = suite.run_benchmark

    def counted(target, drafter, prompts, **kwargs):
        runs.append(suite.params_sha256(drafter.state))
        return real_run(target, drafter, prompts, **kwargs)

    monkeypatch.setattr(suite, "run_benchmark", counted)
    out = tmp_path / "out"

    def run(target, drafter):
        capsys.readouterr()
        report = suite.evaluate(target, {"dspark": drafter}, ["gsm8k"], out, limit=2,
                                progress=False, max_new_tokens=4, batch_size=2)
        return report["results"]["dspark"]["gsm8k"], capsys.readouterr().out

    first, _ = run(target, drafter)
    retrained = dspark_jax.init_drafter(target, seed=3)  # same label, other parameters
    redone, message = run(target, retrained)
    assert runs == [suite.params_sha256(drafter.state), suite.params_sha256(retrained.state)]
    assert "'dspark' on 'gsm8k'" in message and "the drafter changed" in message
    assert "target changed" not in message and redone != first
    recorded = json.loads((out / "dspark" / "gsm8k.json").read_text())["settings"]
    assert recorded["drafter_sha256"] == suite.params_sha256(retrained.state)

    again, message = run(target, retrained)  # the same drafter: reused, nothing printed
    assert len(runs) == 2 and again == redone and message == ""

    retrained.restrict_vocab(np.arange(0, CONFIG["vocab_size"], 2))  # the same parameters
    _, message = run(target, retrained)
    assert len(runs) == 3 and "the draft vocabulary changed (none -> " in message
    assert "drafter changed" not in message
    retrained.restrict_vocab(None)
    _, message = run(target, retrained)
    assert len(runs) == 4 and "the draft vocabulary changed (" in message and "-> none)" in message

    other_target = init_target(CONFIG, seed=4)
    rebound = Drafter(retrained.config, retrained.model_config, retrained.state,
                      retrained.graphdef, other_target)
    _, message = run(other_target, rebound)
    assert len(runs) == 5 and "the target changed" in message and "drafter changed" not in message

    path = out / "dspark" / "gsm8k.json"
    done = json.loads(path.read_text())
    for key in ("drafter_sha256", "target_sha256"):
        del done["settings"][key]  # a result written before results were keyed by the models
    path.write_text(json.dumps(done))
    _, message = run(other_target, rebound)
    assert len(runs) == 6 and "'dspark' on 'gsm8k'" in message
    assert "records no drafter/target identity" in message


def test_domain_means():
    stats = {"gsm8k": {"tau": 2.0}, "math500": {"tau": 4.0}, "mt-bench": {"tau": 1.0}}
    assert suite.domain_means(stats) == {"math": 3.0, "chat": 1.0, "all": pytest.approx(7 / 3)}
    assert np.isclose(suite.domain_means(stats)["all"], 7 / 3)
