"""The recipe's departures from the reference initialisation and learning rates (issue 18).

DeepSpec starts every drafter parameter from N(0, 0.02) (the Markov factors W1 [V, r] and
W2 [r, V] included) and trains all of them at one learning rate. With both Markov factors small
and random, the bias W1[prev] @ W2 and its gradients are tiny: a short run never moves the head.
The train config's recipe fields (:data:`RECIPE_REFERENCE` holds their reference values)
choose other starts, applied once to a freshly initialised drafter before step 0:

  markov_init        "reference": leave init_drafter's N(0, 0.02) factors.
                     "zero_w2": W2 = 0 and W1 ~ N(0, markov_w1_scale), as low-rank adapters
                     start: the bias is zero at step 0 and W2's gradient W1[prev]^T dbias is
                     not, so the head learns from the first step.
                     "bigram": W1, W2 from the truncated SVD of the training data's centred,
                     smoothed log-bigram matrix (:func:`bigram_factors`), times markov_scale:
                     the head starts as the best rank-r bigram bias of the data.
  markov_w1_scale    std of W1 for "zero_w2".
  markov_scale       multiplier of the "bigram" bias (split evenly over W1 and W2).
  bigram_smoothing   beta of the bigram estimate (pseudo-counts, spread like the unigram).
  draft_layers_from  target layer ids whose weights initialise the draft layers, one per draft
                     layer (e.g. the target's last layers); () keeps the random init. The
                     drafter's final norm then starts from the target's final norm.
  lr_multipliers     ((group, factor), ...): the learning rate of a top-level parameter group
                     (``markov_head``, ``layers``, ``fc``, ...) times factor; () for one rate.
  grow_layers        with ``init_from``: the saved drafter may have fewer draft layers than the
                     run's. Its layers come first, each added layer starts from the fresh
                     init with its output projections (attention ``o_proj``, MLP
                     ``down_proj``) zero, an identity residual block (LLaMA Pro's block
                     expansion): the grown drafter computes what the saved one did, and the
                     added layers learn from the first step (:func:`grown_state`).
"""

from __future__ import annotations

import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dspark_jax import storage
from dspark_jax.model_config import layer_groups
from dspark_jax.training.data import load_manifest, read_shard

MARKOV_INITS = ("reference", "zero_w2", "bigram")
# The recipe fields at the reference's values: N(0, 0.02) Markov factors, draft layers from
# init, one learning rate for every parameter.
RECIPE_REFERENCE = dict(markov_init="reference", markov_w1_scale=1.0, markov_scale=1.0,
                        bigram_smoothing=1.0, draft_layers_from=(), lr_multipliers=(),
                        grow_layers=False)
# Name paths of the Markov factors in a drafter's parameters.
W1_PATH = ("markov_head", "markov_w1", "embedding")
W2_PATH = ("markov_head", "markov_w2", "kernel")
# The output projections of a draft layer's residual branches: zero, the layer is the identity.
OUTPUT_PROJECTIONS = (("self_attn", "o_proj"), ("mlp", "down_proj"))


def bigram_counts(data_dirs: Sequence[str | os.PathLike], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Counts of (previous token, answer token) pairs in prepare-data folders.

    A pair is counted where the second token is a loss (answer) token, as the Markov head sees
    it in training: its bias for slot k depends on the token before slot k.

    Returns:
      (keys int64 [n], counts int64 [n]): unique prev * vocab + next keys and their counts.
    """
    keys = []
    for data_dir in data_dirs:
        manifest = load_manifest(data_dir)
        if manifest is None:
            raise ValueError(f"{data_dir} has no manifest.json (not a prepare-data folder)")
        for entry in manifest["files"]:
            shard = read_shard(storage.as_path(data_dir) / entry["file"])
            tokens, mask, offsets = shard["tokens"].astype(np.int64), shard["loss_mask"], shard["offsets"]
            follows = np.ones(len(tokens), bool)
            follows[offsets[:-1]] = False           # a sample's first token has no predecessor
            at = np.nonzero(follows & (mask > 0))[0]
            keys.append(tokens[at - 1] * vocab + tokens[at])
    if not keys or not sum(len(k) for k in keys):
        raise ValueError(f"no answer tokens in {', '.join(map(str, data_dirs))} to count bigrams from")
    return np.unique(np.concatenate(keys), return_counts=True)


def bigram_factors(data_dirs: Sequence[str | os.PathLike], vocab: int, rank: int, *,
                   smoothing: float = 1.0, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """W1 [V, r], W2 [r, V] whose product is the best rank-r approximation of the data's bigram bias.

    With pair counts c_ij, prev counts c_i = sum_j c_ij and the unigram p_j of answer tokens,
    the smoothed bigram law is P(j | i) = (c_ij + beta p_j) / (c_i + beta). Centred per row by
    its value at unseen pairs (a constant per row, to which a softmax bias is blind), its log is

        M_ij = log P(j | i) - log(beta p_j / (c_i + beta)) = log(1 + c_ij / (beta p_j)),

    zero wherever a pair was never seen, so M is sparse. Its truncated SVD U S V^T gives
    W1 = U sqrt(S), W2 = sqrt(S) V^T; rows of W1 for tokens never seen as prev are zero.
    """
    from scipy.sparse import csr_matrix
    from scipy.sparse.linalg import svds

    keys, counts = bigram_counts(data_dirs, vocab)
    prev, nxt = keys // vocab, keys % vocab
    unigram = np.bincount(nxt, weights=counts, minlength=vocab) / counts.sum()
    values = np.log1p(counts / (smoothing * unigram[nxt]))
    matrix = csr_matrix((values, (prev, nxt)), shape=(vocab, vocab))
    rank_used = min(rank, min(matrix.shape) - 1)
    u, s, vt = svds(matrix, k=rank_used, random_state=np.random.default_rng(seed))
    w1 = np.zeros((vocab, rank), np.float32)
    w2 = np.zeros((rank, vocab), np.float32)
    root = np.sqrt(s)
    w1[:, :rank_used] = u * root
    w2[:rank_used] = root[:, None] * vt
    return w1, w2


def name_path(path) -> tuple[str, ...]:
    """The names of a parameter's key path in an ``nnx.State`` (without nnx's "value")."""
    names = (getattr(k, "key", getattr(k, "name", None)) for k in path)
    return tuple(n for n in names if n not in (None, "value"))


def replace_params(state: nnx.State, new: dict[tuple[str, ...], np.ndarray]) -> nnx.State:
    """``state`` with the leaves at the given name paths replaced (same dtype and sharding)."""
    found = set()

    def one(path, leaf):
        names = name_path(path)
        if names not in new:
            return leaf
        found.add(names)
        value = np.asarray(new[names])
        if value.shape != leaf.shape:
            raise ValueError(f"recipe init of {'.'.join(names)}: shape {value.shape}, "
                             f"the drafter has {leaf.shape}")
        return jax.device_put(jnp.asarray(value, leaf.dtype), leaf.sharding)

    out = jax.tree_util.tree_map_with_path(one, state)
    missing = set(new) - found
    if missing:
        raise ValueError(f"recipe init: the drafter has no parameter {sorted(missing)}")
    return out


def initial_state(drafter_state: nnx.State, drafter_config, target_state: nnx.State, train_cfg,
                  data_dirs: Sequence[str | os.PathLike], *, target_config=None) -> nnx.State:
    """The drafter parameters of step 0 under the recipe fields of ``train_cfg`` (module doc).

    Args:
      drafter_state: ``init_drafter``'s parameters (the reference start).
      drafter_config: the drafter config (rank, head, layers).
      target_state: the target's parameters (source of ``draft_layers_from``).
      train_cfg: the train config.
      data_dirs: the training data folders (source of the "bigram" start).
      target_config: the target's model config; needed for ``draft_layers_from`` when its
        full-attention layers are stacked apart (Gemma4): the draft layers take their shape.
    """
    mode = train_cfg.get("markov_init", "reference")
    if mode not in MARKOV_INITS:
        raise ValueError(f"train.markov_init {mode!r}: choose one of {', '.join(MARKOV_INITS)}")
    new = {}
    rank = drafter_config.markov_rank
    if mode != "reference":
        if drafter_config.head != "markov":
            raise ValueError(f"train.markov_init {mode!r} needs the vanilla Markov head, the "
                             f"drafter has head {drafter_config.head!r}")
        vocab = drafter_state["markov_head"]["markov_w1"]["embedding"].shape[0]
        if mode == "zero_w2":
            rng = np.random.default_rng(int(train_cfg.seed))
            new[W1_PATH] = rng.normal(0.0, float(train_cfg.markov_w1_scale), (vocab, rank))
            new[W2_PATH] = np.zeros((rank, vocab))
        else:
            w1, w2 = bigram_factors(data_dirs, vocab, rank, smoothing=float(train_cfg.bigram_smoothing),
                                    seed=int(train_cfg.seed))
            root = np.sqrt(float(train_cfg.markov_scale))
            new[W1_PATH], new[W2_PATH] = w1 * root, w2 * root
    source = tuple(int(i) for i in train_cfg.get("draft_layers_from", ()))
    if source:
        if len(source) != drafter_config.num_layers:
            raise ValueError(f"train.draft_layers_from names {len(source)} target layers for "
                             f"{drafter_config.num_layers} draft layers")
        stacked_apart = target_state.get("global_layers") is not None
        if stacked_apart and target_config is None:
            raise ValueError("train.draft_layers_from over a target with full-attention layers of "
                             "their own shape needs its model config (target_config)")
        ids = (layer_groups(target_config)[-1] if stacked_apart else
               tuple(range(jax.tree.leaves(target_state["layers"])[0].shape[0])))
        if not all(i in ids for i in source):
            raise ValueError(f"train.draft_layers_from {source}: the draft layers can start from the "
                             f"target's layers {list(ids)}"
                             + (" (its full-attention layers)" if stacked_apart else ""))
        index = np.asarray([ids.index(i) for i in source])
        target_layers = target_state["global_layers" if stacked_apart else "layers"]
        for path, leaf in jax.tree_util.tree_flatten_with_path(target_layers)[0]:
            names = name_path(path)
            if names[-1] != "layer_scalar":  # Gemma4's; the draft layers have none
                new[("layers",) + names] = np.asarray(leaf)[index]
        new[("norm", "weight")] = np.asarray(target_state["norm"]["weight"][...])
    return replace_params(drafter_state, new) if new else drafter_state


def grown_state(saved: nnx.State, fresh: nnx.State) -> nnx.State:
    """``fresh`` (a drafter of L draft layers) with every parameter of ``saved`` (the same
    drafter with n <= L layers): layers [0, n) and everything outside the layer stack from
    ``saved``, layers [n, L) from ``fresh`` with their :data:`OUTPUT_PROJECTIONS` zero, so
    each adds nothing to the residual stream and the grown drafter's outputs are the saved
    one's (``grow_layers`` in the module doc).

    Raises:
      ValueError: a parameter outside the stack differs in shape, or ``saved`` has more layers.
    """
    n = jax.tree.leaves(saved["layers"])[0].shape[0]
    total = jax.tree.leaves(fresh["layers"])[0].shape[0]
    if n > total:
        raise ValueError(f"train.grow_layers: the saved drafter has {n} draft layers, the run "
                         f"{total}: a drafter can grow, not shrink")
    new = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(fresh)[0]:
        names = name_path(path)
        old = np.asarray(_at(saved, names))
        if names[0] != "layers":
            if old.shape != leaf.shape:
                raise ValueError(f"train.grow_layers: {'.'.join(names)} has shape {old.shape} "
                                 f"in the saved drafter, {leaf.shape} in the run's")
            new[names] = old
            continue
        value = np.array(leaf, dtype=np.float32)
        value[:n] = old
        if names[1:3] in OUTPUT_PROJECTIONS:
            value[n:] = 0.0
        new[names] = value
    return replace_params(fresh, new)


def _at(state, names: tuple[str, ...]):
    for name in names:
        state = state[name]
    return state[...]


def scale_groups(multipliers: Sequence[tuple[str, float]]) -> optax.GradientTransformation:
    """Multiplies the updates of top-level parameter groups by fixed factors (per-group rates)."""
    factors = {str(name): float(factor) for name, factor in multipliers}

    def update(updates, state, params=None):
        del params

        def one(path, u):
            return u * factors[path[0].key] if path and getattr(path[0], "key", None) in factors else u

        return jax.tree_util.tree_map_with_path(one, updates), state

    def init(params):
        groups = {getattr(path[0], "key", None) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
        unknown = sorted(set(factors) - groups)
        if unknown:
            raise ValueError(f"train.lr_multipliers names unknown parameter group(s) {unknown}; "
                             f"the drafter has {sorted(g for g in groups if g)}")
        return optax.EmptyState()

    return optax.GradientTransformation(init, update)
