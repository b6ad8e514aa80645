"""The drafter's sequential heads and confidence head (paper Eqs. 5-7, DSPARK_SPEC.md section 3).

A sequential head turns the previous token of a block into an additive bias on the backbone's
logits for the next slot. Every head has the same step interface, so the block sampler and the
teacher-forced training forward treat them alike:

  state = head.init_state(batch_shape)                # [..., S] (S = 0 for stateless heads)
  state, bias = head.step(state, prev, hidden)        # prev int [...], hidden [..., d]
                                                      # -> bias float32 [..., V]

(``step(..., columns=head.columns(vocab_ids))`` gives the bias of a draft vocabulary's V'
tokens only, [..., V'].)

and every bias is linear in a rank-r latent: ``step`` is ``project(latent_step(...))`` with
``project(latent) = latent @ W2``, so training can treat the bias as one more linear map into
the vocabulary beside the LM head (``block_latents``; training/losses.py).

The DFlash baseline has no head (``head="none"``): the bias is zero. Parameter names follow the
DeepSpec checkpoint keys (``markov_head.markov_w1`` ...), so the generic Hugging Face name map
gives exactly the spec's tensor names.

Shapes: V vocabulary, r Markov rank, d hidden size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.models.layers import Linear, _param


class TokenTable(nnx.Module):
    """W1: a learned row per token, [V, r] (torch ``nn.Embedding`` weight layout)."""

    def __init__(self, vocab: int, rank: int, *, dtype, rngs: nnx.Rngs):
        self.embedding = _param(rngs, (vocab, rank), dtype, ("vocab", "markov_rank"))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """int [...] -> [..., r]."""
        return jnp.take(self.embedding[...], tokens, axis=0)


class MarkovHead(nnx.Module):
    """Vanilla low-rank Markov head (Eq. 5): bias(prev) = W2 @ W1[prev].

    markov_w1: embedding [V, r]; markov_w2: kernel [r, V] (torch weight [V, r]).
    """

    def __init__(self, *, vocab: int, rank: int, dtype, rngs: nnx.Rngs):
        self.rank = rank
        self.markov_w1 = TokenTable(vocab, rank, dtype=dtype, rngs=rngs)
        self.markov_w2 = Linear(rank, vocab, names=("markov_rank", "vocab"), dtype=dtype, rngs=rngs)

    def prev_embedding(self, prev: jax.Array) -> jax.Array:
        """int [...] -> W1[prev] [..., r]."""
        return self.markov_w1(prev)

    def columns(self, vocab_ids: jax.Array) -> jax.Array:
        """W2's columns of the tokens ``vocab_ids`` int [V'] -> [r, V'] (for :meth:`project`)."""
        return jnp.take(self.markov_w2.kernel[...], vocab_ids, axis=1)

    def project(self, latent: jax.Array, columns: jax.Array | None = None) -> jax.Array:
        """[..., r] -> float32 bias [..., V], or [..., V'] with ``columns`` = ``columns(ids)``."""
        kernel = self.markov_w2.kernel[...] if columns is None else columns
        return jnp.einsum("...r,rv->...v", latent, kernel, preferred_element_type=jnp.float32)

    def init_state(self, batch_shape: tuple[int, ...]) -> jax.Array:
        """The step carry before slot 0: [*batch_shape, 0] (this head is stateless)."""
        return jnp.zeros(batch_shape + (0,), jnp.float32)

    def latent_step(self, state: jax.Array, prev: jax.Array, hidden: jax.Array):
        """(state, prev int [...], hidden [..., d]) -> (state, latent [..., r])."""
        del hidden
        return state, self.prev_embedding(prev)

    def step(self, state: jax.Array, prev: jax.Array, hidden: jax.Array,
             columns: jax.Array | None = None):
        """(state, prev int [...], hidden [..., d]) -> (state, float32 bias [..., V]); with
        ``columns`` (:meth:`columns` of V' tokens), the bias of those tokens [..., V']."""
        state, latent = self.latent_step(state, prev, hidden)
        return state, self.project(latent, columns)


class GatedMarkovHead(MarkovHead):
    """bias = W2(sigmoid(gate_proj([h; W1[prev]])) * W1[prev]); gate_proj [d + r, r] with bias."""

    def __init__(self, *, vocab: int, rank: int, hidden_size: int, dtype, rngs: nnx.Rngs):
        super().__init__(vocab=vocab, rank=rank, dtype=dtype, rngs=rngs)
        self.gate_proj = Linear(hidden_size + rank, rank, names=("head_in", "markov_rank"),
                                dtype=dtype, rngs=rngs, bias=True)

    def latent_step(self, state, prev, hidden):
        emb = self.prev_embedding(prev)
        gate = jax.nn.sigmoid(self.gate_proj(jnp.concatenate([hidden.astype(emb.dtype), emb], -1)))
        return state, gate * emb


class RNNHead(MarkovHead):
    """Gated recurrent head (Eq. 6) with state s [..., r], s_0 = 0.

    z = [s_{k-1}; W1[x_{k-1}]; h_k]; (g, c, o) = split(joint_proj(z), 3) (joint_proj [2r + d, 3r]
    with bias); s_k = sigmoid(g) s_{k-1} + (1 - sigmoid(g)) tanh(c); bias_k = W2 tanh(o).
    """

    def __init__(self, *, vocab: int, rank: int, hidden_size: int, dtype, rngs: nnx.Rngs):
        super().__init__(vocab=vocab, rank=rank, dtype=dtype, rngs=rngs)
        self.joint_proj = Linear(2 * rank + hidden_size, 3 * rank, names=("head_in", "markov_rank"),
                                 dtype=dtype, rngs=rngs, bias=True)

    def init_state(self, batch_shape):
        return jnp.zeros(batch_shape + (self.rank,), jnp.float32)

    def latent_step(self, state, prev, hidden):
        emb = self.prev_embedding(prev)
        z = jnp.concatenate([state.astype(emb.dtype), emb, hidden.astype(emb.dtype)], axis=-1)
        gate, candidate, out = jnp.split(self.joint_proj(z).astype(jnp.float32), 3, axis=-1)
        gate = jax.nn.sigmoid(gate)
        state = gate * state + (1.0 - gate) * jnp.tanh(candidate)
        return state, jnp.tanh(out).astype(emb.dtype)


def make_head(kind: str, *, vocab: int, rank: int, hidden_size: int, dtype,
              rngs: nnx.Rngs) -> MarkovHead | None:
    """The sequential head named by a drafter config (``None`` for "none")."""
    if kind == "none":
        return None
    if kind == "markov":
        return MarkovHead(vocab=vocab, rank=rank, dtype=dtype, rngs=rngs)
    cls = {"gated": GatedMarkovHead, "rnn": RNNHead}[kind]
    return cls(vocab=vocab, rank=rank, hidden_size=hidden_size, dtype=dtype, rngs=rngs)


def block_latents(head: MarkovHead, prev: jax.Array, hidden: jax.Array) -> jax.Array:
    """Teacher-forced latents of a whole block: prev int [..., P], hidden [..., P, d] -> [..., P, r]
    (prev_0 = the anchor); the block's biases are ``head.project`` of them."""

    def step(state, xs):
        p, h = xs
        return head.latent_step(state, p, h)

    _, latent = jax.lax.scan(step, head.init_state(prev.shape[:-1]),
                             (jnp.moveaxis(prev, -1, 0), jnp.moveaxis(hidden, -2, 0)))
    return jnp.moveaxis(latent, 0, -2)


def block_bias(head: MarkovHead | None, prev: jax.Array, hidden: jax.Array) -> jax.Array:
    """Teacher-forced biases of a whole block.

    Args:
      head: a sequential head, or None (zero bias).
      prev: int [..., P], the previous token of each slot (prev_0 = the anchor).
      hidden: [..., P, d] the backbone's hidden states of those slots.

    Returns:
      float32 [..., P, V] (or a float32 zero scalar when ``head`` is None).
    """
    if head is None:
        return jnp.zeros((), jnp.float32)
    return head.project(block_latents(head, prev, hidden))


class ConfidenceHead(nnx.Module):
    """Per-slot acceptance logit (Eq. 7): proj([h_k; W1[prev_k]]) with bias, in float32.

    proj: kernel [d + r, 1] (torch weight [1, d + r]) and bias [1]; r = 0 when the head reads
    h_k alone (no Markov head).
    """

    def __init__(self, *, hidden_size: int, rank: int, dtype, rngs: nnx.Rngs):
        self.proj = Linear(hidden_size + rank, 1, names=("head_in", "confidence"), dtype=dtype,
                           rngs=rngs, bias=True)

    def __call__(self, hidden: jax.Array, prev_embedding: jax.Array | None) -> jax.Array:
        """hidden [..., d], prev_embedding [..., r] or None -> float32 logits [...]."""
        features = hidden if prev_embedding is None else jnp.concatenate(
            [hidden, prev_embedding.astype(hidden.dtype)], axis=-1)
        kernel = self.proj.kernel[...].astype(jnp.float32)
        logit = jnp.einsum("...i,io->...o", features.astype(jnp.float32), kernel)
        return (logit + self.proj.bias[...].astype(jnp.float32))[..., 0]
