"""The recipe's initialisations and per-group learning rates (training/recipe.py)."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

import dspark_jax
from dspark_jax import experiment
from dspark_jax.target import init_target
from dspark_jax.training import recipe
from dspark_jax.training.data import write_manifest, write_shard
from dspark_jax.training.step import make_optimizer

TARGET = dict(architectures=["Qwen3ForCausalLM"], vocab_size=24, hidden_size=32,
              intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, eos_token_id=3)
VOCAB = TARGET["vocab_size"]


@pytest.fixture(scope="module")
def target():
    return init_target(TARGET, seed=1)


@pytest.fixture(scope="module")
def drafter(target):
    return dspark_jax.init_drafter(target, target_layer_ids=(0, 2), mask_token_id=23, block_size=4,
                                   num_layers=2, markov_rank=6, head="markov")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Two shards of samples with prompts (mask 0) and answers (mask 1)."""
    folder = tmp_path_factory.mktemp("recipe_data")
    rng = np.random.default_rng(0)
    files = []
    samples_of = []
    for shard in range(2):
        samples = []
        for i in range(12):
            n = int(rng.integers(8, 30))
            mask = np.zeros(n, np.uint8)
            mask[n // 3:] = 1
            # A skewed law so some pairs repeat often and others never occur.
            ids = np.minimum(rng.geometric(0.25, n) + 3, VOCAB - 1).astype(np.int32)
            samples.append((i, ids, mask))
        write_shard(folder / f"shard_{shard:05d}.npz", samples)
        files.append(dict(file=f"shard_{shard:05d}.npz", samples=len(samples)))
        samples_of += samples
    write_manifest(folder, dict(files=files, num_samples=len(samples_of)))
    return folder, samples_of


def _train_cfg(**fields):
    return ml_collections.ConfigDict(dict(experiment.DSPARK_TRAIN, **fields))


def _flat(state):
    return {jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(state)[0]}


def test_bigram_counts_count_pairs_ending_on_answer_tokens(data):
    folder, samples = data
    expected = {}
    for _, ids, mask in samples:
        for t in range(1, len(ids)):
            if mask[t]:
                key = int(ids[t - 1]) * VOCAB + int(ids[t])
                expected[key] = expected.get(key, 0) + 1
    keys, counts = recipe.bigram_counts([folder], VOCAB)
    assert dict(zip(keys.tolist(), counts.tolist())) == expected


def test_bigram_factors_reproduce_the_centred_log_bigram(data):
    """At full rank W1 @ W2 is M_ij = log(1 + c_ij / (beta p_j)), computed here densely."""
    folder, samples = data
    beta = 2.0
    counts = np.zeros((VOCAB, VOCAB))
    for _, ids, mask in samples:
        for t in range(1, len(ids)):
            if mask[t]:
                counts[ids[t - 1], ids[t]] += 1
    unigram = counts.sum(0) / counts.sum()
    with np.errstate(divide="ignore", invalid="ignore"):
        dense = np.where(counts > 0, np.log1p(counts / (beta * unigram[None, :])), 0.0)
    rank = int(np.linalg.matrix_rank(dense))
    assert rank < VOCAB - 1, "the test needs a low-rank matrix so that svds can reach full rank"
    w1, w2 = recipe.bigram_factors([folder], VOCAB, rank, smoothing=beta)
    assert w1.shape == (VOCAB, rank) and w2.shape == (rank, VOCAB)
    np.testing.assert_allclose(w1 @ w2, dense, atol=1e-4)
    # A lower rank is the best approximation of that rank (Eckart-Young): the SVD's own error.
    w1, w2 = recipe.bigram_factors([folder], VOCAB, 3, smoothing=beta)
    s = np.linalg.svd(dense, compute_uv=False)
    assert np.linalg.norm(w1 @ w2 - dense) == pytest.approx(np.sqrt((s[3:] ** 2).sum()), rel=1e-4)


def test_reference_init_changes_nothing(drafter, target, data):
    out = recipe.initial_state(drafter.state, drafter.config, target.state, _train_cfg(), [data[0]])
    assert out is drafter.state


def test_zero_w2_init(drafter, target, data):
    cfg = _train_cfg(markov_init="zero_w2", markov_w1_scale=0.5)
    out = _flat(recipe.initial_state(drafter.state, drafter.config, target.state, cfg, [data[0]]))
    before = _flat(drafter.state)
    w1 = next(v for k, v in out.items() if "markov_w1" in k)
    w2 = next(v for k, v in out.items() if "markov_w2" in k)
    assert not w2.any()
    assert w1.std() == pytest.approx(0.5, rel=0.15)
    for key, value in before.items():
        if "markov" not in key:
            np.testing.assert_array_equal(out[key], value)


def test_bigram_init_scales_the_bias(drafter, target, data):
    cfg = _train_cfg(markov_init="bigram", markov_scale=0.25, bigram_smoothing=1.0)
    out = _flat(recipe.initial_state(drafter.state, drafter.config, target.state, cfg, [data[0]]))
    w1 = next(v for k, v in out.items() if "markov_w1" in k)
    w2 = next(v for k, v in out.items() if "markov_w2" in k)
    r1, r2 = recipe.bigram_factors([data[0]], VOCAB, 6, smoothing=1.0)
    np.testing.assert_allclose(w1 @ w2, 0.25 * (r1 @ r2), atol=1e-5)


def test_draft_layers_from_target_layers(drafter, target, data):
    cfg = _train_cfg(draft_layers_from=(3, 1))
    out = recipe.initial_state(drafter.state, drafter.config, target.state, cfg, [data[0]])
    got = _flat(out["layers"])
    want = _flat(target.state["layers"])
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key][[3, 1]])
    np.testing.assert_array_equal(np.asarray(out["norm"]["weight"][...]),
                                  np.asarray(target.state["norm"]["weight"][...]))
    np.testing.assert_array_equal(np.asarray(out["fc"]["kernel"][...]),
                                  np.asarray(drafter.state["fc"]["kernel"][...]))


def test_draft_layers_from_gemma4_full_layers(data):
    """Over Gemma4 the draft layers have the shape of the target's full-attention layers (their
    own stack): they start from those, without the target's layer scalars."""
    gemma4 = init_target(dict(TARGET, architectures=["Gemma4ForCausalLM"], global_head_dim=16,
                              num_global_key_value_heads=1, attention_k_eq_v=True,
                              hidden_size_per_layer_input=0, sliding_window=3,
                              layer_types=["sliding_attention", "full_attention"] * 2), seed=2)
    drafter = dspark_jax.init_drafter(gemma4, target_layer_ids=(0, 2), mask_token_id=23, block_size=4,
                                      num_layers=1, markov_rank=6)
    out = recipe.initial_state(drafter.state, drafter.config, gemma4.state,
                               _train_cfg(draft_layers_from=(3,)), [data[0]], target_config=gemma4.config)
    got, want = _flat(out["layers"]), _flat(gemma4.state["global_layers"])
    assert got.keys() == {k for k in want if "layer_scalar" not in k}
    for key in got:
        np.testing.assert_array_equal(got[key], want[key][[1]])  # layer 3 is the second full one
    with pytest.raises(ValueError, match=r"layers \[1, 3\] \(its full-attention layers\)"):
        recipe.initial_state(drafter.state, drafter.config, gemma4.state,
                             _train_cfg(draft_layers_from=(2,)), [data[0]], target_config=gemma4.config)


@pytest.mark.parametrize("fields, message", [
    (dict(markov_init="svd"), "markov_init"),
    (dict(draft_layers_from=(3,)), "1 target layers for 2 draft layers"),
    (dict(draft_layers_from=(3, 4)), r"can start from the target's layers \[0, 1, 2, 3\]"),
])
def test_bad_recipe_fields_are_named(drafter, target, data, fields, message):
    with pytest.raises(ValueError, match=message):
        recipe.initial_state(drafter.state, drafter.config, target.state, _train_cfg(**fields), [data[0]])


def test_bigram_init_needs_the_markov_head(target, data):
    gated = dspark_jax.init_drafter(target, target_layer_ids=(0, 2), mask_token_id=23, block_size=4,
                                    num_layers=1, markov_rank=6, head="gated")
    with pytest.raises(ValueError, match="vanilla Markov head"):
        recipe.initial_state(gated.state, gated.config, target.state, _train_cfg(markov_init="bigram"),
                             [data[0]])


def test_lr_multipliers_scale_one_group():
    params = {"markov_head": {"w": jnp.ones(3)}, "fc": {"w": jnp.ones(2)}}
    grads = {"markov_head": {"w": jnp.full(3, 0.5)}, "fc": {"w": jnp.full(2, 0.5)}}

    def first_update(**fields):
        opt = make_optimizer(_train_cfg(learning_rate=1e-2, warmup_ratio=0.0, **fields), 10)
        updates, _ = opt.update(grads, opt.init(params), params)
        return updates

    base = first_update()
    scaled = first_update(lr_multipliers=(("markov_head", 10.0), ("fc", 0.0)))
    np.testing.assert_allclose(scaled["markov_head"]["w"], 10 * base["markov_head"]["w"], rtol=1e-6)
    assert not np.asarray(scaled["fc"]["w"]).any() and np.asarray(base["fc"]["w"]).all()
    with pytest.raises(ValueError, match="unknown parameter group"):
        make_optimizer(_train_cfg(lr_multipliers=(("markov", 2.0),)), 10).init(params)


def test_warm_start_loads_a_saved_drafter_of_the_same_config(drafter, target, tmp_path):
    from dspark_jax.training.trainer import warm_start_params

    drafter.save(tmp_path / "saved", layout="deepspec")
    params = warm_start_params(str(tmp_path / "saved"), drafter)
    got, want = _flat(params), _flat(drafter.state)
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])
    other = dspark_jax.init_drafter(target, target_layer_ids=(0, 2), mask_token_id=23,
                                    block_size=5, num_layers=2, markov_rank=6, head="markov")
    with pytest.raises(ValueError, match=r"differs in block_size \(4, the run has 5\)"):
        warm_start_params(str(tmp_path / "saved"), other)


def test_a_drafter_grows_by_identity_layers_and_drafts_as_before(drafter, target, tmp_path):
    """``train.grow_layers``: a 2-layer drafter warm-starts a 3-layer run; the saved layers come
    first, the added one has zero output projections, and the grown drafter's teacher-forced
    logits and confidences are the saved one's."""
    from flax import nnx

    from dspark_jax.training.trainer import warm_start_params

    drafter.save(tmp_path / "saved", layout="deepspec")
    grown = dspark_jax.init_drafter(target, target_layer_ids=(0, 2), mask_token_id=23,
                                    block_size=4, num_layers=3, markov_rank=6, head="markov",
                                    seed=7)
    with pytest.raises(ValueError, match=r"differs in num_layers \(2, the run has 3\)"):
        warm_start_params(str(tmp_path / "saved"), grown)
    params = warm_start_params(str(tmp_path / "saved"), grown, grow_layers=True)
    got, saved, fresh = _flat(params), _flat(drafter.state), _flat(grown.state)
    assert got.keys() == fresh.keys()
    for key, value in got.items():
        if "'layers'" not in key:
            np.testing.assert_array_equal(value, saved[key], err_msg=key)
            continue
        np.testing.assert_array_equal(value[:2], saved[key], err_msg=key)
        if "o_proj" in key or "down_proj" in key:
            assert not value[2].any(), key
        else:
            np.testing.assert_array_equal(value[2], fresh[key][2], err_msg=key)
            assert value[2].any(), key

    ids = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB - 1, (1, 12)))
    taps = jnp.asarray(np.random.default_rng(1).normal(size=(1, 12, 2 * 32)), jnp.float32)
    anchors, keep = jnp.array([[1, 5, 8]]), jnp.ones((1, 3), bool)

    def forward(graphdef, state):
        out = nnx.merge(graphdef, state).forward_train(
            target.model, input_ids=ids, taps=taps, anchors=anchors, keep=keep,
            loss_mask=jnp.ones((1, 12), bool))
        return np.asarray(out.logits), np.asarray(out.confidence)

    for want, have in zip(forward(drafter.graphdef, drafter.state), forward(grown.graphdef, params)):
        np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-5)
    deep = dspark_jax.init_drafter(target, target_layer_ids=(0, 2), mask_token_id=23,
                                   block_size=4, num_layers=1, markov_rank=6, head="markov")
    with pytest.raises(ValueError, match="can grow, not shrink"):
        warm_start_params(str(tmp_path / "saved"), deep, grow_layers=True)
