"""serve-bench on a tiny random target: steps/s profiling, closed-loop load, reports; the eval
prompt loader and the profiling policy."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax
from dspark_jax.scheduling import sps
from dspark_jax.serving import bench, loadgen
from dspark_jax.engine import engine as engine_lib
from dspark_jax.engine import step as step_lib
from dspark_jax.models import cpu_kernels
from dspark_jax.target import init_target

QWEN3 = dict(architectures=["Qwen3ForCausalLM"], vocab_size=48, hidden_size=32, intermediate_size=64,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             eos_token_id=3, max_position_embeddings=512)


@pytest.mark.slow  # profiles and serve-bench runs; CI runs -m slow
def test_serve_bench_smoke(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(tmp_path / "cache"))
    target = init_target(QWEN3, seed=1)
    drafter = dspark_jax.init_drafter(target, seed=2, block_size=3)  # P = 3 proposals
    prompts = [[5, 9, 11, 7], [4, 8, 15, 16, 23], [17], [2, 2, 5, 6, 7, 8], [40, 1, 9]]
    calls = []
    timed = loadgen.closed_loop

    def counted(engine, *args, **kwargs):
        calls.append((engine.policy, int(engine.policy_params["gamma"])))
        return timed(engine, *args, **kwargs)

    monkeypatch.setattr(bench, "closed_loop", counted)
    result = bench.serve_bench(target, drafter, prompts, policies=["prefix", "fixed1", "fixed-best"],
                               concurrency=[2], max_new_tokens=6, temperature=1.0, buckets=(4,),
                               repeats=2, sps_repeats=2, sps_warmup=1, progress=lambda _: None)
    # fixed1 and fixed-best's gamma 1 share their runs; the repeats go round-robin.
    variants = [("prefix", 3), ("fixed", 1), ("fixed", 2), ("fixed", 3)]
    assert calls == variants * 2
    prefix, fixed1, fixed = result["rows"]
    assert [r["policy"] for r in result["rows"]] == ["prefix", "fixed1", "fixed-best"]
    assert [r["gamma"] for r in fixed["sweep"]] == [1, 2, 3]
    assert fixed["gamma"] in (1, 2, 3) and fixed1["gamma"] == 1
    assert fixed["tokens_per_s"] == max(r["tokens_per_s"] for r in fixed["sweep"])
    assert fixed["sweep"][0]["tokens_per_s"] == fixed1["tokens_per_s"]
    for row in result["rows"]:
        # The row is the lower-median run of the two.
        assert len(row["tokens_per_s_runs"]) == 2
        assert row["tokens_per_s"] == min(row["tokens_per_s_runs"])
        assert row["concurrency"] == 2 and row["requests"] == len(prompts)
        assert len(prompts) <= row["new_tokens"] <= 6 * len(prompts)
        assert row["tokens_per_s"] > 0 and row["tokens_per_s_per_user"] > 0
        assert 0 <= row["mean_proposal_len"] <= 3 and 1 <= row["tau"] <= 4
        assert set(row["bucket_counts"]) <= {4, 8}
    assert fixed["mean_proposal_len"] == fixed["gamma"]
    # The steps/s profile covers every token bucket of the 2-slot engine and is cached.
    profile = sps.SPSProfile.from_json(result["sps"][2])
    assert profile.grid == [4, 8] and all(len(s) == 2 for s in profile.samples)
    assert profile.table().shape == (9,) and sps.cache_file(profile.key).exists()
    paths = bench.write_report(result, tmp_path / "out")
    assert json.loads(paths["json"].read_text())["rows"][0]["policy"] == "prefix"
    table = paths["markdown"].read_text().splitlines()
    assert table[0].startswith("| policy | C | tokens/s | runs (tokens/s) |") and len(table) == 5
    low, high = sorted(prefix["tokens_per_s_runs"])
    assert f"| {low:.1f}-{high:.1f} |" in table[2]
    assert paths["plot"].read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="repeats >= 1"):
        bench.serve_bench(target, drafter, prompts, policies=["full"], concurrency=[1],
                          max_new_tokens=2, repeats=0)


@pytest.mark.slow  # profiles and serve-bench runs; CI runs -m slow
def test_sps_cache_follows_the_step_program(tmp_path, monkeypatch):
    """A cached profile is reused only while the profiled step program is the same: a change
    to the step's code measures a new one (the stale-table trap of an upgrade)."""
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(tmp_path))
    target = init_target(QWEN3, seed=1)
    drafter = dspark_jax.init_drafter(target, seed=2, block_size=3)

    def profile():
        engine = engine_lib.Engine(target, drafter, slots=1, max_len=16, buckets=(2,))
        return engine.profile_sps(temperature=1.0, repeats=1, warmup=0)

    first = profile()
    assert len(first.key["program"]) == 16 and first.key["jax"] == jax.__version__
    assert profile().created == first.created  # a new engine, the same program: cached
    run_rounds = step_lib.run_rounds

    @functools.wraps(run_rounds)
    def changed(*args, **kwargs):
        slots, caches, out = run_rounds(*args, **kwargs)
        return slots, caches, out._replace(verified_tokens=out.verified_tokens * 1)

    monkeypatch.setattr(step_lib, "run_rounds", changed)
    second = profile()
    assert second.key["program"] != first.key["program"] and second.created > first.created
    assert {k: v for k, v in second.key.items() if k != "program"} == \
        {k: v for k, v in first.key.items() if k != "program"}
    assert len(list((tmp_path / "sps").glob("*.json"))) == 2
    assert second.key["kernels"] == list(cpu_kernels.registered())
    # A CPU kernel rebuilt from another source: the StableHLO names only its target, the key
    # its build.
    monkeypatch.setitem(cpu_kernels._REGISTERED, "cpu_matmul.cc", "cpu_matmul-0123456789abcdef.so")
    third = profile()
    assert third.key["kernels"] != second.key["kernels"] and third.created > second.created


def test_policy_specs():
    assert bench.parse_policy("fixed-best", 3) == [("fixed", {"gamma": g}) for g in (1, 2, 3)]
    assert bench.parse_policy("fixed1", 7) == [("fixed", {"gamma": 1})]
    assert bench.parse_policy("threshold0.4", 7) == [("threshold", {"threshold": 0.4})]
    assert bench.parse_policy("production", 7) == [("production", {})]
    with pytest.raises(ValueError, match="gamma must be in 1..7"):
        bench.parse_policy("fixed9", 7)
    with pytest.raises(ValueError, match="unknown policy spec"):
        bench.parse_policy("sometimes", 7)


def test_spread_drafts_hits_the_requested_total():
    active = jnp.asarray([True, False, True, True])
    lengths = engine_lib.spread_drafts(None, None, active, {"gamma": jnp.int32(8)})
    assert int(jnp.sum(jnp.where(active, lengths, 0))) == 8
    np.testing.assert_array_equal(np.asarray(lengths)[[0, 2, 3]], [3, 3, 2])


class CharTokenizer:
    chat_template = None

    def __call__(self, text):
        return {"input_ids": [ord(c) % 50 for c in text]}


def test_eval_prompts_round_robin_first_turns(tmp_path):
    (tmp_path / "gsm8k.jsonl").write_text('{"turns": ["a1", "ignored"]}\n{"turns": ["a2"]}\n')
    (tmp_path / "mbpp.jsonl").write_text('{"turns": ["b1 is a long prompt"]}\n{"turns": ["b2"]}\n')
    tok = CharTokenizer()
    prompts = loadgen.eval_prompts(tok, ["gsm8k", "mbpp"], 3, max_prompt_len=4, data_dir=tmp_path)
    assert prompts == [tok(t)["input_ids"] for t in ("a1", "a2", "b2")]
    with pytest.raises(ValueError, match="only 3 prompts"):
        loadgen.eval_prompts(tok, ["gsm8k", "mbpp"], 4, max_prompt_len=4, data_dir=tmp_path)
    with pytest.raises(ValueError, match="not found"):
        loadgen.eval_prompts(tok, ["alpaca"], 1, max_prompt_len=4, data_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown benchmark"):
        loadgen.eval_prompts(tok, ["gsm9k"], 1, max_prompt_len=4, data_dir=tmp_path)
    with pytest.raises(ValueError, match="no tokenizer"):
        loadgen.eval_prompts(None, ["gsm8k"], 1, max_prompt_len=4, data_dir=tmp_path)
