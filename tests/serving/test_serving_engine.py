"""The continuous-batching engine on a tiny random target with an untrained drafter: greedy output
equals autoregressive output for every policy with requests joining at different steps, mixed
per-request sampling settings, compile counts and input errors."""

import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax
import law
from dspark_jax import engine as engine_lib
from dspark_jax.decoding import round as round_lib
from dspark_jax.engine import Engine, token_buckets
from dspark_jax.engine import engine as engine_module
from dspark_jax.target import init_target

QWEN3 = dict(architectures=["Qwen3ForCausalLM"], vocab_size=48, hidden_size=32, intermediate_size=64,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             eos_token_id=3, max_position_embeddings=512)
PROMPTS = [[5, 9, 11, 7], [4, 8, 15, 16, 23, 42, 7, 6, 10, 12, 14, 20, 21, 22, 30, 31, 32, 33], [17],
           [2, 2, 2, 5, 6, 7, 8], [40, 41, 1, 9, 9, 13]]
ARRIVALS = {0: [0, 1], 1: [2], 3: [3], 6: [4]}  # step -> prompts submitted before it
MAX_NEW = 20
SLOTS = 3  # fewer slots than requests: slots are reused
BUCKETS = (4, 12)  # -> (4, 12, 24) flat verify tokens
POLICIES = [("full", None), ("fixed", {"gamma": 2}), ("threshold", {"threshold": 0.5}),
            ("prefix", {"sps": [1.0] * 9 + [0.6] * 16}),
            ("production", {"sps": [1.0] * 6 + [0.7] * 6 + [0.4] * 13})]
# The default run checks greedy == AR for full and production; the others with -m slow.
POLICY_CASES = [case if case[0] in ("full", "production") else pytest.param(*case, marks=pytest.mark.slow)
                for case in POLICIES]


@pytest.fixture(scope="module")
def qwen3():
    return init_target(QWEN3, seed=1)


@pytest.fixture(scope="module")
def ar_reference(qwen3):
    return [r.token_ids for r in dspark_jax.generate(qwen3, PROMPTS, max_new_tokens=MAX_NEW)]


@pytest.fixture(scope="module")
def traced_widths():
    """Token counts of every trace of the speculative flat verify forward (one per bucket per
    program; the prefill's forward, over a cache of no slots, and the autoregressive reference's
    rows of width 1 are not counted)."""
    widths = []
    original = round_lib.ragged_forward

    def recording(model, tokens, positions, rows, cols, starts, cache, **kwargs):
        if cache.num_slots and kwargs["width"] > 1:
            widths.append(tokens.shape[0])
        return original(model, tokens, positions, rows, cols, starts, cache, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(round_lib, "ragged_forward", recording)
        yield widths


@pytest.fixture(scope="module")
def engine(qwen3, traced_widths):
    drafter = dspark_jax.init_drafter(qwen3, seed=2)
    return Engine(qwen3, drafter, slots=SLOTS, max_len=64, buckets=BUCKETS)


def serve(engine, arrivals, sampling=None):
    """Submits prompts at their arrival steps (``sampling``: per-prompt settings) and steps
    until everything finished."""
    requests, step = {}, 0
    while step <= max(arrivals) or engine.busy:
        for i in arrivals.get(step, []):
            options = (sampling or {}).get(i, {})
            requests[i] = engine.submit(PROMPTS[i], max_new_tokens=MAX_NEW, **options)
        engine.step()
        step += 1
    return [requests[i] for i in sorted(requests)]


@pytest.mark.parametrize("policy,params", POLICY_CASES)
def test_greedy_equals_autoregressive_for_every_policy(engine, ar_reference, policy, params):
    engine.set_policy(policy, params)
    engine.reset_stats()
    requests = serve(engine, ARRIVALS)
    assert [r.tokens for r in requests] == ar_reference
    for r in requests:
        c = r.counters
        assert r.done and c["rounds"] >= 1 and r.tau >= 1.0
        assert c["accepted"] <= c["proposal_len_sum"]
        # Every token after the first comes from a round; the last round may be cut.
        assert len(r.tokens) - 1 <= c["tau_sum"] <= len(r.tokens) - 1 + engine.num_proposals
    # Forward tokens per step = active requests + verified drafts, never above the top bucket.
    assert engine.verified_tokens == engine.active_slot_steps + sum(r.counters["proposal_len_sum"]
                                                                    for r in requests)
    assert set(engine.bucket_counts) <= set(engine.buckets)
    if policy == "fixed":
        assert all(r.counters["proposal_len_sum"] == 2 * r.counters["rounds"] for r in requests)


def test_mixed_sampling_settings_keep_greedy_requests_exact(engine, ar_reference):
    """Sampled requests (temperature, top-p, top-k per slot) share steps with greedy ones."""
    engine.set_policy("full")
    sampled = {1: dict(temperature=1.0, top_p=0.9), 2: dict(temperature=0.7, top_k=5)}
    requests = serve(engine, ARRIVALS, sampled)
    for i, r in enumerate(requests):
        if i not in sampled:
            assert r.tokens == ar_reference[i]
        assert 1 <= len(r.tokens) <= MAX_NEW


def test_compiles_once_per_policy_and_prompt_bucket(engine, traced_widths, ar_reference):
    """Run after the tests above: one program of rounds per policy, one admission per
    (admitted rows, prompt width, flat tokens) bucket, each program of rounds traced the flat
    forward once per token bucket, and serving the same load again compiles nothing."""
    keys = engine.program_keys
    rounds = [key for key in keys if key[0] == "rounds"]
    admits = [key for key in keys if key[0] == "admit"]
    # The policies whose tests ran (the default run leaves three to -m slow), one program each.
    ran = {key[2] for key in rounds}
    assert {"full", "production"} <= ran <= {p for p, _ in POLICIES} and len(rounds) == len(ran)
    assert len(rounds) + len(admits) == engine.num_compiled == len(keys)
    for _, rows, width, flat in admits:  # prompts of <= 16 and 17..32 tokens, up to 3 at once
        assert rows in (1, 2, 4) and width in (16, 32) and 16 <= flat <= rows * width
    assert engine.buckets == (4, 12, 24)
    assert sorted(traced_widths) == sorted(list(engine.buckets) * len(rounds))
    before = len(engine_lib.compiled_programs())
    engine.set_policy("full")
    assert [r.tokens for r in serve(engine, ARRIVALS)] == ar_reference
    assert len(engine_lib.compiled_programs()) == before


def test_abort_frees_the_slot_and_leaves_the_others_exact(engine, ar_reference):
    """Aborting a running request frees its slot for the queue and keeps its tokens so far (a
    prefix of its greedy answer); aborting a queued one drops it; the others stay exact."""
    engine.set_policy("full")
    running = engine.submit(PROMPTS[0], max_new_tokens=MAX_NEW)
    others = [engine.submit(PROMPTS[i], max_new_tokens=MAX_NEW) for i in (1, 2)]
    queued = engine.submit(PROMPTS[3], max_new_tokens=MAX_NEW)
    late = engine.submit(PROMPTS[4], max_new_tokens=MAX_NEW)  # needs the aborted slot
    engine.step()
    engine.step()
    assert engine.slots_in_use == SLOTS and engine.queue_length == 2
    assert engine.abort(queued) and engine.queue_length == 1
    assert engine.abort(running) and engine.slots_in_use == SLOTS - 1
    assert not engine.abort(running)
    assert running.finish_reason == queued.finish_reason == "abort" and queued.tokens == []
    assert 2 <= len(running.tokens) < MAX_NEW
    assert running.tokens == ar_reference[0][:len(running.tokens)]
    engine.run()
    assert [r.tokens for r in others + [late]] == [ar_reference[i] for i in (1, 2, 4)]
    assert {r.finish_reason for r in others + [late]} <= {"stop", "length"}
    assert engine.slots_in_use == 0 and not engine.busy


def test_a_seeded_request_samples_the_same_tokens_alone_and_in_a_batch(engine):
    """Each slot draws from its request's own key: a seeded sampled request gives the same
    tokens alone and beside other (sampled) requests, and another seed gives others."""
    engine.set_policy("full")

    def tokens(seed, company):
        others = [engine.submit(PROMPTS[i], max_new_tokens=MAX_NEW, temperature=1.0)
                  for i in company]
        request = engine.submit(PROMPTS[1], max_new_tokens=MAX_NEW, temperature=1.0, top_k=20,
                                seed=seed)
        engine.run()
        assert all(o.done for o in others)
        return request.tokens

    alone = tokens(7, [])
    assert tokens(7, [0, 2, 3]) == alone == tokens(7, [4])
    assert tokens(8, []) != alone


def test_the_process_keeps_only_the_most_recently_used_programs(qwen3, monkeypatch):
    """At most ``MAX_PROGRAMS`` programs stay compiled, least recently used dropped first:
    XLA:CPU maps each kernel of a program into memory on its own, and a process that kept
    every program crashed in a compile at Linux's 65,530 mappings (the slow suite did). A
    dropped program is compiled again when needed and gives the same tokens."""
    monkeypatch.setattr(engine_module._PROGRAMS, "capacity", 2)
    engine_lib.clear_compiled_programs()
    engine = Engine(qwen3, None, slots=1, max_len=64)

    def run(prompt):
        before = engine.compile_s
        request = engine.submit(prompt, max_new_tokens=3)
        engine.run()
        return request.tokens, engine.compile_s > before

    short, long = [5, 9, 11], list(range(4, 24))
    first, compiled = run(short)  # admission (width 16) and rounds
    assert compiled and len(engine_lib.compiled_programs()) == 2
    assert run(long)[1] and len(engine_lib.compiled_programs()) == 2  # width 32 drops width 16
    again, compiled = run(short)
    assert compiled and again == first and len(engine_lib.compiled_programs()) == 2
    assert run(short) == (first, False)  # kept now


def test_programs_are_dropped_before_the_process_runs_out_of_memory_mappings(qwen3, monkeypatch):
    """Compiling drops the least recently used programs while the process holds more memory
    mappings than its budget (a share of Linux's vm.max_map_count), however few programs it
    keeps: an evaluation of two drafters over nine sets crashed. Dropping frees the programs'
    mappings (JAX's caches let go of them too)."""
    assert engine_module.mapping_budget() > 10_000 and engine_module.memory_mappings() > 0
    engine_lib.clear_compiled_programs()
    engine = Engine(qwen3, None, slots=1, max_len=64)

    def run(prompt):
        request = engine.submit(prompt, max_new_tokens=3)
        engine.run()
        return request.tokens

    first = run([5, 9, 11])
    assert len(engine_lib.compiled_programs()) == 2  # the admission (width 16) and the rounds
    held = engine_module.memory_mappings()
    monkeypatch.setattr(engine_module, "mapping_budget", lambda: held - 100)  # over budget now
    run(list(range(4, 24)))  # a width-32 admission to compile: the width-16 one goes first
    widths = [key[key.index("admit") + 2] for key in engine_module._PROGRAMS._cache
              if "admit" in key]  # (.., "admit", rows, width, flat tokens)
    assert widths == [32], widths
    assert engine_module.memory_mappings() < held  # what was dropped is freed
    monkeypatch.setattr(engine_module, "mapping_budget", lambda: None)
    assert run([5, 9, 11]) == first


def test_cache_views_are_powers_of_two_within_the_cache():
    assert [engine_module.cache_view(n, 736) for n in (1, 128, 129, 256, 300, 513, 736)] == [
        128, 128, 256, 256, 512, 736, 736]
    assert engine_module.cache_view(5, 64) == 64


@pytest.mark.parametrize("drafted", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_rows_that_outgrow_their_cache_view_continue_in_the_next(qwen3, ar_reference, monkeypatch,
                                                                 drafted):
    """With views from 8 slots up (prompt buckets: 16, 32 and 64 here), requests cross several views
    while others join and leave: the tokens are the greedy reference's, and each view is one
    program."""
    monkeypatch.setattr(engine_module, "MIN_VIEW", 8)
    drafter = dspark_jax.init_drafter(qwen3, seed=2) if drafted else None
    engine = Engine(qwen3, drafter, slots=SLOTS, max_len=64, buckets=BUCKETS if drafted else None)
    assert [r.tokens for r in serve(engine, ARRIVALS)] == ar_reference
    views = sorted(key[-1] for key in engine.program_keys if key[0] == "rounds")
    assert views == [16, 32, 64]
    requests = [engine.submit(p, max_new_tokens=MAX_NEW) for p in PROMPTS]
    engine.run()  # many rounds per call: a run stops when a row outgrows its view
    assert [r.tokens for r in requests] == ar_reference


@pytest.mark.slow  # the default run checks the same lag in tests/decoding/test_speculative.py
def test_policy_sees_each_slots_confidences_of_two_steps_earlier():
    """A callable policy's ``lagged`` holds, per slot, the confidences of the block it verified
    two steps earlier, and the prior ``NO_HISTORY`` in a request's first two steps (here a
    request joins while another is running)."""
    target, drafter = law.law_models()  # no EOS: requests run to their limits
    engine = Engine(target, drafter, slots=2, max_len=32, policy=law.recording_policy)
    law.POLICY_CALLS.clear()
    engine.submit(law.PROMPT, max_new_tokens=12, temperature=1.0)
    engine.step()
    engine.step()
    engine.submit(law.PROMPT, max_new_tokens=8, temperature=1.0)
    engine.run()
    conf, lagged, active = (np.stack(x) for x in zip(*law.POLICY_CALLS))  # [steps, S, ...]
    assert active[:2].tolist() == [[True, False]] * 2 and active[2].all()
    for slot in range(2):
        age = np.cumsum(active[:, slot]) - 1  # steps the slot's request has run before
        for t in np.flatnonzero(active[:, slot]):
            want = conf[t - 2, slot] if age[t] >= 2 else np.full_like(conf[t, slot], round_lib.NO_HISTORY)
            np.testing.assert_allclose(lagged[t, slot], want, rtol=1e-6, err_msg=f"{slot} {t}")
    assert (age >= 2).sum() >= 2  # the second request reached its third step


def test_token_buckets():
    assert token_buckets(64, 7) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    assert token_buckets(3, 7) == (1, 2, 4, 8, 16, 24)
    assert token_buckets(2, 3, (3, 5, 100)) == (3, 5, 8)


def test_flat_layout_is_the_marker_tensor():
    lengths = jnp.asarray([2, 7, 0, 3])
    active = jnp.asarray([True, False, True, True])
    rows, cols, total = round_lib.flat_layout(lengths, active, 10)
    assert int(total) == 3 + 1 + 4
    np.testing.assert_array_equal(rows, [0, 0, 0, 2, 3, 3, 3, 3, 4, 4])
    np.testing.assert_array_equal(cols, [0, 1, 2, 0, 0, 1, 2, 3, 0, 0])


def test_input_errors(engine, qwen3):
    with pytest.raises(ValueError, match="empty"):
        engine.submit([], max_new_tokens=4)
    with pytest.raises(ValueError, match="does not fit the slot size max_len=64"):
        engine.submit([1] * 60, max_new_tokens=8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit([1, 480], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.submit([1, 2], max_new_tokens=0)
    with pytest.raises(ValueError, match="unknown verification policy"):
        engine.set_policy("sometimes")
    other = dspark_jax.init_drafter(init_target(QWEN3, seed=9))
    with pytest.raises(ValueError, match="another target"):
        Engine(qwen3, other, slots=2, max_len=32)
    assert not engine.busy
