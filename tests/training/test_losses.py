"""The DSpark loss (spec section 5): formula against numpy, detached confidence label, chunking."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from ml_collections import ConfigDict

import dspark_jax
from dspark_jax.target import init_target
from dspark_jax.training import losses, recipe

TINY = dict(architectures=["Qwen3ForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
CFG = ConfigDict(dict(loss_decay_gamma=4.0, ce_loss_alpha=0.1, l1_loss_alpha=0.9,
                      confidence_head_alpha=1.0))


def _prefix_mask(rng, shape, first):
    """Random contiguous valid prefixes over the proposal slots (slot < first never valid)."""
    lengths = rng.integers(0, shape[-1] - first + 1, shape[:-1])
    slots = np.arange(shape[-1]) - first
    return (slots >= 0) & (slots < lengths[..., None])


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _numpy_loss(draft, target, labels, conf, mask, first, gamma):
    p, q = _softmax(draft.astype(np.float64)), _softmax(target.astype(np.float64))
    ce = -np.log(np.take_along_axis(p, labels[..., None], -1)[..., 0])
    l1 = np.abs(p - q).sum(-1)
    alpha = np.clip(1 - 0.5 * l1, 0, 1)
    k = np.maximum(np.arange(mask.shape[-1]) - first, 0)
    w = mask * np.exp(-k / gamma)
    bce = np.maximum(conf, 0) - conf * alpha + np.log1p(np.exp(-np.abs(conf)))
    den = w.sum() + 1e-6
    terms = dict(ce=(w * ce).sum() / den, l1=(w * l1).sum() / den, conf=(w * bce).sum() / den)
    valid_alpha = (alpha * mask)[..., first:]
    has_valid = mask.any(-1)
    return dict(
        terms, loss=0.1 * terms["ce"] + 0.9 * terms["l1"] + terms["conf"], w=w, alpha=alpha,
        accept=valid_alpha.sum((0, 1)) / mask[..., first:].sum((0, 1)),
        tau=((1 + np.cumprod(valid_alpha, -1).sum(-1)) * has_valid).sum() / has_valid.sum(),
        conf_error=(np.abs(1 / (1 + np.exp(-conf)) - alpha) * mask).sum() / mask.sum())


@pytest.fixture
def example(request):
    first = request.param
    rng = np.random.default_rng(first)
    shape, vocab = (2, 5, 4), 11
    draft = (2 * rng.normal(size=shape + (vocab,))).astype(np.float32)
    # the target close to the draft on some slots, so alpha spans (0, 1]
    target = (draft + rng.normal(size=draft.shape) * rng.uniform(0, 3, shape)[..., None]).astype(np.float32)
    labels = rng.integers(0, vocab, shape).astype(np.int32)
    conf = rng.normal(size=shape).astype(np.float32)
    mask = _prefix_mask(rng, shape, first)
    return first, draft, target, labels, conf, mask


def _sums(draft, target, labels, conf, mask, first, cfg=CFG):
    ce, l1 = losses.slot_terms(draft, target, labels)
    return losses.reduce_terms(ce, l1, conf, jnp.asarray(mask), first_proposal_slot=first,
                               loss_decay_gamma=4.0, ce_alpha=cfg.ce_loss_alpha,
                               l1_alpha=cfg.l1_loss_alpha)


@pytest.mark.parametrize("example", [0, 1], indirect=True, ids=["anchor_predicts", "dflash_slots"])
def test_loss_matches_numpy(example):
    first, draft, target, labels, conf, mask = example
    ref = _numpy_loss(draft, target, labels, conf, mask, first, 4.0)
    assert 0.05 < ref["alpha"][mask].min() and ref["alpha"][mask].max() > 0.5
    metrics = losses.metrics(_sums(draft, target, labels, conf, mask, first), CFG)
    for key, ref_key in [("loss", "loss"), ("ce_loss", "ce"), ("l1_loss", "l1"),
                         ("confidence_loss", "conf"), ("tau_probabilistic", "tau"),
                         ("confidence_abs_error", "conf_error")]:
        np.testing.assert_allclose(metrics[key], ref[ref_key], rtol=1e-5, err_msg=key)
    rates = [metrics[f"accept_rate@{k}"] for k in range(mask.shape[-1] - first)]
    np.testing.assert_allclose(rates, ref["accept"], rtol=1e-5)
    assert metrics["valid_tokens"] == mask.sum()


@pytest.mark.parametrize("example", [0], indirect=True)
def test_confidence_label_is_detached(example):
    """d loss / d conf = w (sigmoid(conf) - alpha) / sum w; alpha passes no gradient back."""
    first, draft, target, labels, conf, mask = example
    ref = _numpy_loss(draft, target, labels, conf, mask, first, 4.0)
    only_conf = ConfigDict(dict(CFG, ce_loss_alpha=0.0, l1_loss_alpha=0.0))

    def loss(draft, target, conf):
        return losses.total_loss(_sums(draft, target, labels, conf, mask, first, only_conf), only_conf)

    g_draft, g_target, g_conf = jax.grad(loss, argnums=(0, 1, 2))(draft, target, conf)
    expected = ref["w"] * (1 / (1 + np.exp(-conf)) - ref["alpha"]) / (ref["w"].sum() + 1e-6)
    np.testing.assert_allclose(g_conf, expected, rtol=1e-4, atol=1e-7)
    assert not np.any(g_draft) and not np.any(g_target)


# A Gemma3 target whose logits are soft-capped at 2 (the cap bends most of them): the fused
# gradient applies the cap before the head's bias, as the draft logits do.
GEMMA3 = dict(TINY, architectures=["Gemma3ForCausalLM"], final_logit_softcapping=2.0,
              sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2)


@pytest.fixture(scope="module", params=[
    "markov", "none", "markov-gemma3",
    # the gated and RNN heads differ only in how their latents are made (plain autodiff)
    pytest.param("gated", marks=pytest.mark.slow), pytest.param("rnn", marks=pytest.mark.slow)])
def model_case(request):
    head, _, family = request.param.partition("-")
    target = init_target(GEMMA3 if family else TINY, seed=1)
    drafter = dspark_jax.init_drafter(target, seed=2, num_layers=1, markov_rank=8, block_size=4,
                                      head=head)
    if head != "none":  # W2 ~ N(0, 1): a bias that matters for every slot
        w2 = drafter.state["markov_head"]["markov_w2"]["kernel"]
        drafter.state = recipe.replace_params(drafter.state, {
            ("markov_head", "markov_w2", "kernel"): np.random.default_rng(4).normal(size=w2.shape)})
    rng = np.random.default_rng(3)
    seq = 20
    ids = jnp.asarray(rng.integers(0, 64, (2, seq)), jnp.int32)
    loss_mask = jnp.asarray(np.arange(seq) >= 3).astype(jnp.int32)[None].repeat(2, 0)
    anchors = jnp.array([[3, 5, 9, 14, 18], [4, 8, 11, 0, 0]], jnp.int32)
    keep = jnp.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
    return target, drafter, ids, loss_mask, anchors, keep


@pytest.mark.parametrize("chunks", [(3,), pytest.param((1, 5), marks=pytest.mark.slow)])
def test_chunked_loss_equals_unchunked(model_case, chunks):
    """Chunks of 1, 3 and N anchors (the fused CE / L1 gradient of ``vocab_loss``) give the same
    sums and gradients (w.r.t. the drafter and its hidden states) as autodiff of the full
    [b, N, B, V] logits, for every sequential head."""
    target, drafter, ids, loss_mask, anchors, keep = model_case
    tmodel = target.model
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    t_out = tmodel(ids, positions, tap_layer_ids=drafter.config.target_layer_ids)
    out = jax.jit(lambda m: m.forward_train(tmodel, input_ids=ids, taps=t_out.taps, anchors=anchors,
                                            keep=keep, loss_mask=loss_mask))(drafter.model)

    def sums_fn(state, hidden, chunk):
        model = nnx.merge(drafter.graphdef, state)
        conf = model.confidence(hidden, out.prev)
        if chunk is None:  # the full logits
            index = losses.target_slot_index(anchors, 4, model.first_proposal_slot, ids.shape[1])
            t_hidden = jnp.take_along_axis(t_out.hidden, index.reshape(2, -1)[..., None], axis=1)
            logits = tmodel.logits(t_hidden).reshape(out.logits.shape)
            ce, l1 = losses.slot_terms(model.logits(tmodel, hidden, out.prev), logits, out.labels)
            return losses.reduce_terms(ce, l1, conf, out.eval_mask, first_proposal_slot=0,
                                       loss_decay_gamma=4.0, ce_alpha=CFG.ce_loss_alpha,
                                       l1_alpha=CFG.l1_loss_alpha)
        chunk_out = out._replace(hidden=hidden, confidence=conf, logits=None)
        return losses.loss_sums(model, tmodel, chunk_out, t_out.hidden, anchors,
                                loss_decay_gamma=4.0, ce_alpha=CFG.ce_loss_alpha,
                                l1_alpha=CFG.l1_loss_alpha, anchor_chunk=chunk)

    def loss_and_grad(chunk):
        def fn(state, hidden):
            sums = sums_fn(state, hidden, chunk)
            return losses.total_loss(sums, CFG), sums
        return jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))(drafter.state, out.hidden)

    (ref_loss, ref_sums), ref_grad = loss_and_grad(None)
    assert float(ref_sums["tokens"]) > 20
    for chunk in chunks:
        (loss, sums), grad = loss_and_grad(chunk)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, atol=1e-6)
        for key in ref_sums:
            np.testing.assert_allclose(sums[key], ref_sums[key], rtol=1e-6, atol=1e-6, err_msg=key)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grad, ref_grad)
