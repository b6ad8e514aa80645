"""The engine's per-round trace (record=True) and the STS temperatures it applies."""

import numpy as np
import pytest

import dspark_jax
from dspark_jax.checkpoints.errors import CheckpointError
from dspark_jax.target import init_target

pytestmark = pytest.mark.slow  # recorded runs of the whole engine, one program per temperature

CONFIG = dict(architectures=["Qwen3ForCausalLM"], vocab_size=48, hidden_size=32,
              intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, eos_token_id=3, max_position_embeddings=512)
PROMPTS = [[5, 9, 11, 7], [4, 8, 15, 16, 23, 42, 7], [17]]


@pytest.fixture(scope="module")
def pair():
    target = init_target(CONFIG, seed=1)
    return target, dspark_jax.init_drafter(target, seed=2)


def test_trace_matches_the_counters(pair):
    target, drafter = pair
    temperature = 1.0
    plain = dspark_jax.generate(target, PROMPTS, max_new_tokens=20, drafter=drafter,
                                temperature=temperature, seed=3)
    recorded = dspark_jax.generate(target, PROMPTS, max_new_tokens=20, drafter=drafter,
                                   temperature=temperature, seed=3, record=True)
    proposals = drafter.num_proposals
    for a, r in zip(plain, recorded):
        assert a.token_ids == r.token_ids and a.trace is None
        t, c = r.trace, r.stats["counters"]
        assert t["confidence_logits"].shape == (c["rounds"], proposals)
        assert np.all(t["proposal_len"] == proposals)  # full verification
        assert int(t["num_accepted"].sum()) == c["accepted"]
        assert [int((t["num_accepted"] >= k).sum()) for k in range(1, proposals + 1)] \
            == c["accepted_ge"]
        assert np.all(np.isfinite(t["confidence_logits"]))


def test_temperatures_change_what_a_threshold_policy_verifies(pair):
    target, drafter = pair
    logits = dspark_jax.generate(target, PROMPTS[:1], max_new_tokens=12, drafter=drafter,
                                 record=True)[0].trace["confidence_logits"]
    # A threshold between the raw confidences and those at temperature 100 (all near 0.5).
    threshold = float(np.clip(1 / (1 + np.exp(-logits[0, 0])), 0.05, 0.95))
    threshold = 0.5 + (threshold - 0.5) / 2
    runs = {}
    for temps in (None, np.full(drafter.num_proposals, 100.0, np.float32)):
        drafter.confidence_temperatures = temps
        res = dspark_jax.generate(target, PROMPTS[:1], max_new_tokens=12, drafter=drafter,
                                  verify="threshold", verify_params={"threshold": threshold},
                                  record=True)[0]
        runs[temps is None] = res
    drafter.confidence_temperatures = None
    ar = dspark_jax.generate(target, PROMPTS[:1], max_new_tokens=12)[0].token_ids
    assert runs[True].token_ids == runs[False].token_ids == ar
    assert runs[True].trace["proposal_len"][0] != runs[False].trace["proposal_len"][0]


def test_calibration_is_saved_and_loaded_with_the_drafter(pair, tmp_path):
    target, drafter = pair
    temps = np.linspace(0.5, 2.0, drafter.num_proposals)
    with pytest.raises(ValueError, match="confidence temperatures"):
        drafter.calibrate(temps[:-1])
    copy = dspark_jax.load_drafter(drafter.save(tmp_path / "d"), target)
    assert copy.confidence_temperatures is None
    copy.calibrate(temps, {"method": "sts"})
    again = dspark_jax.load_drafter(copy.save(tmp_path / "c", target_tensors=False), target)
    np.testing.assert_allclose(again.confidence_temperatures, temps, rtol=1e-6)
    assert again.calibration_fit == {"method": "sts"}
    (tmp_path / "c" / "calibration.json").write_text('{"confidence_temperatures": [1.0]}')
    with pytest.raises(CheckpointError, match="calibration.json"):
        dspark_jax.load_drafter(tmp_path / "c", target)


def test_compact_bfloat16_checkpoint_round_trip(pair, tmp_path):
    import jax.numpy as jnp

    target, drafter = pair
    path = drafter.save(tmp_path / "bf16", dtype=jnp.bfloat16, target_tensors=False)
    full = drafter.save(tmp_path / "full")
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size < 0.5 * sum(f.stat().st_size for f in full.iterdir())
    loaded = dspark_jax.load_drafter(path, target)
    ar = dspark_jax.generate(target, PROMPTS, max_new_tokens=12)
    sp = dspark_jax.generate(target, PROMPTS, max_new_tokens=12, drafter=loaded)
    assert [r.token_ids for r in sp] == [r.token_ids for r in ar]


def test_unknown_drafter_name_is_a_clear_error(pair):
    with pytest.raises(ValueError, match="not a packaged drafter"):
        dspark_jax.load_drafter("no-such-drafter", pair[0])
