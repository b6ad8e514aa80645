"""serve-bench on a tiny random target: steps/s profiling, closed-loop load, reports; the eval
prompt loader and the profiling policy."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax
from dspark_jax.scheduling import sps
from dspark_jax.serving import bench, loadgen
from dspark_jax.serving import engine as engine_lib
from dspark_jax.target import init_target

QWEN3 = dict(architectures=["Qwen3ForCausalLM"], vocab_size=48, hidden_size=32, intermediate_size=64,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             eos_token_id=3, max_position_embeddings=512)


def test_serve_bench_smoke(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(tmp_path / "cache"))
    target = init_target(QWEN3, seed=1)
    drafter = dspark_jax.init_drafter(target, seed=2, block_size=3)  # P = 3 proposals
    prompts = [[5, 9, 11, 7], [4, 8, 15, 16, 23], [17], [2, 2, 5, 6, 7, 8], [40, 1, 9]]
    result = bench.serve_bench(target, drafter, prompts, policies=["prefix", "fixed-best"],
                               concurrency=[2], max_new_tokens=6, temperature=1.0, buckets=(4,),
                               sps_repeats=2, sps_warmup=1, progress=lambda _: None)
    prefix, fixed = result["rows"]
    assert prefix["policy"] == "prefix" and fixed["policy"] == "fixed-best"
    assert [r["gamma"] for r in fixed["sweep"]] == [1, 2, 3]
    assert fixed["gamma"] in (1, 2, 3)
    assert fixed["tokens_per_s"] == max(r["tokens_per_s"] for r in fixed["sweep"])
    for row in result["rows"]:
        assert row["concurrency"] == 2 and row["requests"] == len(prompts)
        assert len(prompts) <= row["new_tokens"] <= 6 * len(prompts)
        assert row["tokens_per_s"] > 0 and row["tokens_per_s_per_user"] > 0
        assert 0 <= row["mean_budget"] <= 3 and 1 <= row["tau"] <= 4
        assert set(row["bucket_counts"]) <= {4, 8}
    assert fixed["mean_budget"] == fixed["gamma"]
    # The steps/s profile covers every token bucket of the 2-slot engine and is cached.
    profile = sps.SPSProfile.from_json(result["sps"][2])
    assert profile.grid == [4, 8] and all(len(s) == 2 for s in profile.samples)
    assert profile.table().shape == (9,) and sps.cache_file(profile.key).exists()
    paths = bench.write_report(result, tmp_path / "out")
    assert json.loads(paths["json"].read_text())["rows"][0]["policy"] == "prefix"
    table = paths["markdown"].read_text().splitlines()
    assert table[0].startswith("| policy | C | tokens/s") and len(table) == 4
    assert paths["plot"].read_bytes()[:4] == b"\x89PNG"


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
