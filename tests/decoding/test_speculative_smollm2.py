"""Greedy speculative decoding on the real SmolLM2-135M-Instruct equals greedy autoregressive
decoding token for token, on prompts of the shared eval sets, with the trained drafter shipped
in the package (each of them) and with an untrained one of the same shape."""

import json
from pathlib import Path

import pytest

import dspark_jax
from dspark_jax.engine.stats import sum_counters

pytestmark = pytest.mark.slow  # the real SmolLM2 with the packaged drafter; CI runs -m slow

DATA = Path(__file__).parents[2].parent / "shared" / "data" / "eval"


def first_turns():
    texts = []
    for name in ("gsm8k.jsonl", "humaneval.jsonl", "mt-bench.jsonl"):
        path = DATA / name
        if not path.exists():
            pytest.skip(f"evaluation prompts {path} are absent")
        with path.open() as f:
            texts.append(json.loads(next(f))["turns"][0])
    return texts


@pytest.mark.parametrize("name", sorted(dspark_jax.drafter.PACKAGED_DRAFTERS))
def test_packaged_trained_drafter(smollm2, name):
    """Each trained drafter shipped with the package: greedy output still equals
    autoregressive output, and it is accepted more often than an untrained drafter."""
    prompts = first_turns()
    trained = dspark_jax.load_drafter(name, smollm2)
    untrained = dspark_jax.init_drafter(smollm2, trained.config, seed=0)
    ar = dspark_jax.generate(smollm2, prompts, max_new_tokens=48)
    taus = {}
    for name, drafter in (("trained", trained), ("untrained", untrained)):
        sp = dspark_jax.generate(smollm2, prompts, max_new_tokens=48, drafter=drafter)
        assert [s.token_ids for s in sp] == [a.token_ids for a in ar]
        counters = sum_counters([s.stats["counters"] for s in sp])
        taus[name] = counters["tau_sum"] / counters["rounds"]
    assert taus["trained"] > taus["untrained"] + 0.05, taus
