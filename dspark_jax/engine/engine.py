"""The one engine: continuous batching over S slots, a host loop around two jitted programs.

``Engine(target, drafter, slots=S, max_len=N)`` owns S slots with their KV cache rows
(``decoding/round.py``). Requests are queued by :meth:`Engine.submit`; :meth:`Engine.step`
admits queued requests into free slots (one batched prefill, ``engine/step.py: admit``) and
runs one round over all slots; :meth:`Engine.run` repeats that until everything finished,
running many rounds per call and returning to the host only when a request ends while others
wait for a slot. Without a drafter it decodes autoregressively (the same round with no
proposals). ``generate`` is an offline client of this engine, as the server is an online one.

Compiled programs are shared by every engine of the process (:func:`compiled_programs`): one
run of rounds per verification policy (and SPS table length; its verify forward is a
``lax.switch`` over the token buckets) and one admission per (admitted rows, prompt width,
flat tokens) bucket; sampling settings, policy parameters and the SPS table's values are
traced, so changing them never recompiles. The process keeps at most :data:`MAX_PROGRAMS`,
the most recently used, and fewer when they take too many memory mappings: XLA:CPU loads each
kernel of a program as its own mappings (1,000-2,000 for a speculative run of rounds on
SmolLM2), and a process past Linux's limit (``vm.max_map_count``, 65,530 by default) crashes in
its next compile, as an evaluation of two drafters over nine prompt sets once did. Before each
compile the least recently used programs are dropped, with JAX's own caches (which keep every
executable compiled in the process), until the process holds at most :data:`MAPPING_SHARE` of
the limit. Under ``jax.set_mesh`` (with the models loaded
under the same mesh) the engine runs data parallel over slots and tensor parallel over heads:
cache rows are sharded over the data axes, kv heads over the tensor axis, and the small slot
state is replicated.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.decoding import block_sampler
from dspark_jax.decoding import round as round_lib
from dspark_jax.decoding.sampling import GREEDY_TEMPERATURE, SamplingParams
from dspark_jax.engine import step as step_lib
from dspark_jax.engine.stats import row_counters, stats_from_counters
from dspark_jax.models import cpu_kernels
from dspark_jax.models import layer_weights as layer_weights_lib
from dspark_jax.models.kv_cache import KVCache
from dspark_jax.prompts import prompt_bucket
from dspark_jax.scheduling import sps as sps_lib
from dspark_jax.scheduling import verification

# One call of run_rounds runs at most this many rounds (a bound on host silence, not on output).
MAX_ROUNDS_PER_CALL = 1 << 20
# Compiled programs kept per process (least recently used dropped first); see the module doc.
MAX_PROGRAMS = 32
# Share of the process's memory-mapping limit above which compiling drops old programs first.
MAPPING_SHARE = 0.6
# The narrowest cache view of a run of rounds (cache_view).
MIN_VIEW = 128


def sampling_mode(temperature: float, top_p: float, top_k: int) -> str:
    """"greedy", "sampled" or "sampled-truncated" (top-p < 1 or top-k > 0): what a step's cost
    depends on among the sampling parameters."""
    if temperature <= GREEDY_TEMPERATURE:
        return "greedy"
    return "sampled-truncated" if top_p < 1.0 or top_k > 0 else "sampled"


@dataclasses.dataclass
class Request:
    """A request and what the engine recorded about it (times from ``time.perf_counter``)."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None  # its own PRNG seed (None: from the engine's seed and its id)
    tokens: list[int] = dataclasses.field(default_factory=list)  # generated, EOS included
    # Speculative counters (``engine.stats.COUNTERS``), up to date after every engine call.
    counters: dict = dataclasses.field(default_factory=dict)
    # With record_rounds: {"confidence_logits": float32 [r, P], "proposal_len": int32 [r],
    # "num_accepted": int32 [r]} of its r rounds (numpy), set when it finished.
    trace: dict | None = None
    submitted_at: float = 0.0
    admitted_at: float | None = None
    finished_at: float | None = None
    # Why it ended: "stop" (an EOS token), "length" (max_new_tokens) or "abort" (Engine.abort).
    finish_reason: str | None = None

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    @property
    def stats(self) -> dict:
        """:func:`engine.stats.stats_from_counters` of this request."""
        return stats_from_counters(self.counters)

    @property
    def tau(self) -> float | None:
        return self.stats["tau"] if self.counters else None


def cache_view(length: int, max_len: int) -> int:
    """Cache slots a run of rounds reads while every committed length is at most ``length``:
    ``length``'s prompt bucket (a power of two up to 1,024, then a multiple of 1,024), at least
    :data:`MIN_VIEW`, at most ``max_len``.

    The verify attention of a round reads the view, not the whole cache (a row's tokens never
    see slots past its committed length), so rows holding 200 tokens of a 736-slot cache read
    256 slots each; the run stops when a row outgrows its view, and the host continues it with
    the next one. The buckets keep the number of programs per engine small.
    """
    return min(max_len, max(MIN_VIEW, prompt_bucket(length)))


def token_buckets(slots: int, proposals: int,
                  buckets: Sequence[int] | None = None) -> tuple[int, ...]:
    """Flat token counts of the verify forward, sorted, the last one S * (P + 1).

    Default: the powers of two below S * (P + 1), e.g. (1, 2, 4, ..., 256, 512) for 64 slots and
    7 proposals. A round runs with the smallest bucket >= its verified tokens.
    """
    top = slots * (proposals + 1)
    if buckets is None:
        buckets = [1 << i for i in range(top.bit_length()) if (1 << i) < top]
    return tuple(sorted({int(b) for b in buckets if 0 < int(b) < top} | {top}))


def spread_drafts(confidences, lagged, active, params):
    """Profiling policy: ``params["gamma"]`` draft tokens in total, spread evenly over the
    active slots (earlier slots take the remainder). int32 [S]."""
    del confidences, lagged
    rank = jnp.cumsum(active.astype(jnp.int32)) - 1
    count = jnp.maximum(jnp.sum(active.astype(jnp.int32)), 1)
    total = params["gamma"]
    return (total // count + (rank < total % count)).astype(jnp.int32)


class _Programs:
    """Compiled programs of every engine, keyed by (program, model structures, parameter
    shardings, state shapes, statics): the ``capacity`` most recently used ones."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lowered = {}  # lowered by a fingerprint, not compiled yet
        self._fingerprints = {}

    def _lower(self, fn, args, static):
        jitted = jax.jit(fn, static_argnums=(0, 2), static_argnames=tuple(static),
                         donate_argnums=(4, 5))
        return jitted.lower(*args, **static)

    def get(self, key, fn, args, static) -> tuple:
        """(compiled program, seconds spent lowering and compiling it now: 0 when cached)."""
        key = (fn,) + key
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key], 0.0
        start = time.perf_counter()
        lowered = self._lowered.pop(key, None) or self._lower(fn, args, static)
        while len(self._cache) >= self.capacity:
            self._cache.popitem(last=False)
        budget = mapping_budget()
        while self._cache and budget is not None and memory_mappings() > budget:
            self._cache.popitem(last=False)
            jax.clear_caches()  # JAX's own caches keep a dropped executable (and its mappings)
        self._cache[key] = lowered.compile()
        return self._cache[key], time.perf_counter() - start

    def fingerprint(self, key, fn, args, static) -> str:
        """16 hex digits of the sha256 of the program's StableHLO text: it changes whenever the
        computation does (code, shapes, dtypes, shardings), and only then."""
        key = (fn,) + key
        if key not in self._fingerprints:
            lowered = self._lower(fn, args, static)
            if key not in self._cache:
                self._lowered[key] = lowered  # compiled from it later, not lowered twice
            self._fingerprints[key] = hashlib.sha256(lowered.as_text().encode()).hexdigest()[:16]
        return self._fingerprints[key]

    def clear(self):
        self._cache.clear()
        self._lowered.clear()
        self._fingerprints.clear()
        jax.clear_caches()


def memory_mappings() -> int | None:
    """The memory mappings this process holds now (Linux's /proc/self/maps), else None."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


def mapping_budget() -> int | None:
    """:data:`MAPPING_SHARE` of this process's mapping limit (``vm.max_map_count``), or None
    where the system has no such limit to read (then only :data:`MAX_PROGRAMS` bounds)."""
    try:
        with open("/proc/sys/vm/max_map_count") as limit:
            return int(MAPPING_SHARE * int(limit.read()))
    except (OSError, ValueError):
        return None


_PROGRAMS = _Programs(MAX_PROGRAMS)
# Model structures (graphdefs, dtypes, parameter shardings) -> a small id for program keys, so
# that a step's key is hashed in microseconds (ids are never reused within a process).
_MODELS: dict = {}


def compiled_programs() -> list:
    """The engine programs the process keeps (``jax.stages.Compiled``, least recently used
    first; at most :data:`MAX_PROGRAMS`)."""
    return list(_PROGRAMS._cache.values())


def clear_compiled_programs() -> None:
    """Forgets every compiled engine program (and JAX's trace caches, so code changes apply)."""
    _PROGRAMS.clear()


def draft_vocab(target, drafter, weight_dtype=None) -> block_sampler.DraftVocab | None:
    """The drafter's draft vocabulary (``Drafter.draft_vocab``) with its tokens' LM head rows
    (in ``weight_dtype``, the drafter's weight dtype; None: the target's) and head columns,
    gathered once (an engine does at creation, for all its programs); None without a drafter
    or a draft vocabulary."""
    if drafter is None or drafter.draft_vocab is None:
        return None

    def gather(target_state, drafter_state, ids):
        vocab = block_sampler.gather_draft_vocab(nnx.merge(drafter.graphdef, drafter_state),
                                                 nnx.merge(target.graphdef, target_state), ids)
        if weight_dtype is None:
            return vocab
        return vocab._replace(lm_head_rows=vocab.lm_head_rows.astype(weight_dtype))

    return jax.jit(gather)(target.state, drafter.state, jnp.asarray(drafter.draft_vocab))


def _shardings(state) -> tuple:
    return tuple(leaf.sharding for leaf in jax.tree.leaves(state))


def machine_sps_table(target, drafter, *, slots: int, prompt_len: int, max_new_tokens: int,
                      temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                      weight_dtype=None, draft_weight_dtype=None) -> np.ndarray:
    """This machine's steps/s table float32 [slots * (P + 1) + 1] by forward tokens, for
    ``slots`` requests of prompts up to ``prompt_len`` tokens and ``max_new_tokens``: the
    profile of the engine's round (:meth:`Engine.profile_sps`, cache rows rounded up to a
    multiple of 256 so that similar runs share it; ``weight_dtype``, ``draft_weight_dtype`` as
    the engine's), measured once per key and then read from the cache."""
    cache = prompt_bucket(prompt_len) + max_new_tokens + drafter.num_proposals + 1
    engine = Engine(target, drafter, slots=slots, max_len=-(-cache // 256) * 256,
                    weight_dtype=weight_dtype, draft_weight_dtype=draft_weight_dtype)
    return engine.profile_sps(temperature=temperature, top_p=top_p, top_k=top_k).table()


class Engine:
    """Continuous batching with S slots over a target and, optionally, its drafter.

    Args:
      target: a loaded Target; drafter: a Drafter of ``target`` (None: autoregressive).
      slots: S, the number of requests decoded together.
      max_len: N, cache slots per request: prompt + max_new_tokens must fit.
      policy, policy_params: the verification policy (``verification.POLICIES`` or a function)
        and its parameters, e.g. {"gamma": 2} or {"sps": table}; see :meth:`set_policy`.
      buckets: flat token counts of the verify forward (default :func:`token_buckets`).
      seed: PRNG seed of the sampling.
      record_rounds: R, rounds of each request to record (``Request.trace``; 0: none).
      layer_weights: how the programs read the target's layer weights, "stacked" or
        "unstacked" (``Target.inference_state``: unstacked holds one more copy of them in
        memory); None: ``layer_weights.default_layout``, unstacked on one CPU device for at
        most 4 slots (or, where ``models.cpu_matmul`` runs, a widest forward of at most 32
        rows: slots x (P + 1) with a drafter), or for any number with ``weight_dtype``
        bfloat16. The drafter's layers follow ``Drafter.inference_state``
        (per-layer arrays where its block's rows run faster so).
      weight_dtype: the dtype of the target's weight matrices in the programs, e.g. bfloat16
        under a float32 target: each matmul multiplies in bfloat16 and accumulates in float32
        (``layer_weights.with_dtype``; one more copy of the matrices); None: the target's own.
      draft_weight_dtype: likewise for the drafter's matrices (``Drafter.inference_state``) and
        its draft vocabulary's LM head rows; None: the drafter's own. Outputs stay exact: it
        changes only the draft law, which rejection sampling corrects.
    """

    def __init__(self, target, drafter=None, *, slots: int, max_len: int, policy="full",
                 policy_params: dict | None = None, buckets: Sequence[int] | None = None,
                 seed: int = 0, record_rounds: int = 0, layer_weights: str | None = None,
                 weight_dtype=None, draft_weight_dtype=None):
        if drafter is not None and drafter.target is not target:
            raise ValueError("the drafter was built for another target object")
        if slots < 1 or max_len < 2:
            raise ValueError(f"need slots >= 1 and max_len >= 2, got {slots} and {max_len}")
        self.target, self.drafter = target, drafter
        # The target's layer weights in this layout (Target.inference_state, read per program).
        self.weight_dtype = None if weight_dtype is None else jnp.dtype(weight_dtype)
        widest = slots * (1 + (0 if drafter is None else drafter.num_proposals))  # a verify
        self.layer_weights = layer_weights or layer_weights_lib.default_layout(
            target.state, slots, self.weight_dtype, forward_rows=widest)
        self._target_state()  # checks the names, makes the copy now
        self.draft_weight_dtype = (None if drafter is None or draft_weight_dtype is None
                                   or jnp.dtype(draft_weight_dtype) == drafter.dtype
                                   else jnp.dtype(draft_weight_dtype))
        self.num_slots, self.max_len = slots, max_len
        self.num_proposals = 0 if drafter is None else drafter.num_proposals
        # The drafter's STS temperatures (``Drafter.calibrate``) as of engine creation.
        self._temperatures = (np.ones((self.num_proposals,), np.float32)
                              if drafter is None or drafter.confidence_temperatures is None
                              else np.asarray(drafter.confidence_temperatures, np.float32))
        # Its draft vocabulary (``Drafter.draft_vocab``; None: the whole vocabulary), likewise.
        self._draft_vocab = draft_vocab(target, drafter, self.draft_weight_dtype)
        self.buckets = token_buckets(slots, self.num_proposals, buckets)
        self.eos_ids = jnp.asarray(target.eos_token_ids or (-1,), jnp.int32)
        self._eos_set = frozenset(target.eos_token_ids or ())
        self._key = jax.random.key(seed)
        self.seed = seed
        self.compile_s = 0.0
        self._used: set = set()  # keys (without the engine's structure) of the programs it ran
        self._structure_id = None
        self.set_policy(policy, policy_params)
        cfg = target.config
        draft_width = cfg.vocab_size if self._draft_vocab is None else self._draft_vocab.ids.shape[0]

        def empty_state(key):
            d_cache = None if drafter is None else drafter.model.init_cache(slots, max_len)
            caches = round_lib.Caches(
                KVCache.for_model(cfg, slots, max_len, target.dtype), d_cache)
            return round_lib.laid_out(
                round_lib.Slots.empty(slots, self.num_proposals, draft_width, max_len, key,
                                      record_rounds), caches)

        # Under jax.set_mesh the state is laid out over the mesh (round.laid_out); every leaf is
        # its own buffer, so the state can be donated.
        self._slots, self._caches = jax.jit(empty_state)(self._key)
        self._free = list(range(slots))
        self._running: dict[int, Request] = {}
        self._queue: collections.deque[Request] = collections.deque()
        self._next_id = 0
        self.reset_stats()

    # -- configuration ---------------------------------------------------------------------

    def set_policy(self, policy, policy_params: dict | None = None) -> None:
        """Chooses the verification policy of the next rounds.

        ``"prefix"`` and ``"production"`` read a steps/s table {"sps": [...]} indexed by flat
        verify tokens (:meth:`profile_sps`); without one they see a flat table (and warn).

        Raises:
          ValueError: an unknown policy or parameter.
        """
        self.policy_params = verification.default_params(policy, self.num_slots, self.num_proposals,
                                                          policy_params, self._temperatures)
        self.policy = policy

    def reset_stats(self) -> None:
        """Zeroes the engine counters (rounds, verified tokens, bucket use)."""
        self.steps = 0
        self.verified_tokens = 0
        self.active_slot_steps = 0
        self.bucket_counts = collections.Counter()

    @property
    def program_keys(self) -> list[tuple]:
        """The programs this engine has run: ("rounds", buckets, policy, SPS table length, cache
        view) and
        ("admit", admitted rows, prompt width, flat tokens); each is compiled once per process."""
        return sorted(self._used, key=repr)

    @property
    def num_compiled(self) -> int:
        """Distinct programs this engine has run (:attr:`program_keys`)."""
        return len(self._used)

    @property
    def busy(self) -> bool:
        return bool(self._queue or self._running)

    @property
    def queue_length(self) -> int:
        """Requests submitted and not admitted yet."""
        return len(self._queue)

    @property
    def slots_in_use(self) -> int:
        """Slots holding a running request."""
        return len(self._running)

    # -- programs ---------------------------------------------------------------------------

    def _target_state(self):
        """The target's state as this engine's programs read it (layout and weight dtype)."""
        return self.target.inference_state(self.layer_weights, self.weight_dtype)

    def _drafter_state(self):
        """The drafter's state as this engine's programs read it (weight dtype)."""
        return self.drafter.inference_state(self.draft_weight_dtype)

    def _models(self):
        d = self.drafter
        return (self.target.graphdef, self._target_state(),
                None if d is None else d.graphdef,
                None if d is None else self._drafter_state())

    def _structure(self) -> tuple:
        """What every program of this engine depends on besides its own shapes: (an id of) the
        model structures, dtypes and parameter shardings, and the state's shapes."""
        if self._structure_id is None:
            t, d = self.target, self.drafter
            models = (t.graphdef, str(t.dtype), self.layer_weights, str(self.weight_dtype),
                      _shardings(self._target_state()))
            if d is not None:
                models += (d.graphdef, str(d.dtype), str(self.draft_weight_dtype),
                           _shardings(self._drafter_state()))
            self._structure_id = _MODELS.setdefault(models, len(_MODELS))
        return (self._structure_id, self.num_slots, self.max_len,
                self._slots.trace.proposal_len.shape[1], self.eos_ids.shape[0],
                None if self._draft_vocab is None else self._draft_vocab.ids.shape[0])

    def _program(self, key, fn, args, static):
        program, seconds = _PROGRAMS.get(self._structure() + key, fn, args, static)
        self.compile_s += seconds
        self._used.add(key)
        return program

    def _rounds_program(self, policy, policy_params, eos_ids, view: int):
        """(program key, args, static args) of a run of rounds under ``policy`` reading ``view``
        cache slots."""
        args = self._models() + (self._slots, self._caches, eos_ids, policy_params,
                                 self._draft_vocab, jnp.int32(1), jnp.bool_(False))
        key = ("rounds", self.buckets, policy if self.drafter is not None else None,
               policy_params["sps"].shape[0], view)
        return key, args, dict(buckets=self.buckets, policy=policy, view=view)

    def _view(self) -> int:
        """The cache view of the running requests: each has committed its prompt, its tokens
        harvested so far and at most one more (sampled by its admission, not harvested yet)."""
        longest = max(len(r.prompt) + len(r.tokens) + 1 for r in self._running.values())
        return cache_view(longest, self.max_len)

    def _run_rounds(self, limit: int, stop_on_finish: bool, policy=None, policy_params=None,
                    eos_ids=None, view: int | None = None) -> step_lib.RunSummary:
        policy = self.policy if policy is None else policy
        policy_params = self.policy_params if policy_params is None else policy_params
        eos_ids = self.eos_ids if eos_ids is None else eos_ids
        view = self._view() if view is None else view
        key, args, static = self._rounds_program(policy, policy_params, eos_ids, view)
        args = args[:-2] + (jnp.int32(limit), jnp.bool_(stop_on_finish))
        program = self._program(key, step_lib.run_rounds, args, static)
        self._slots, self._caches, summary = program(*(a for i, a in enumerate(args)
                                                       if i not in (0, 2)))
        return summary

    def _prompt_width(self, length: int) -> int:
        return min(prompt_bucket(length), self.max_len)

    def _admissions(self, pairs: Sequence[tuple[int, Request]]) -> tuple[round_lib.Admissions, int]:
        """The admission pytree of (slot, request) pairs and its static prompt width W: rows
        padded to a power of two, prompts laid out flat and padded to a prompt bucket."""
        rows = 1 << (len(pairs) - 1).bit_length()
        lengths = [len(r.prompt) for _, r in pairs]
        width = self._prompt_width(max(lengths))
        flat = min(prompt_bucket(sum(lengths)), rows * width)
        tokens, row_of, cols = (np.zeros((flat,), np.int32) for _ in range(3))
        row_of[:] = rows
        at = 0
        for i, (_, r) in enumerate(pairs):
            n = len(r.prompt)
            tokens[at:at + n], row_of[at:at + n], cols[at:at + n] = r.prompt, i, np.arange(n)
            at += n
        pad = rows - len(pairs)

        def column(values, fill, dtype):
            return np.asarray(list(values) + [fill] * pad, dtype)

        requests = [r for _, r in pairs]
        admissions = round_lib.Admissions(
            slot=column((s for s, _ in pairs), self.num_slots, np.int32),
            length=column(lengths, 1, np.int32), tokens=tokens, rows=row_of, cols=cols,
            max_new=column((r.max_new_tokens for r in requests), 1, np.int32),
            sampling=SamplingParams(column((r.temperature for r in requests), 0.0, np.float32),
                                    column((r.top_p for r in requests), 1.0, np.float32),
                                    column((r.top_k for r in requests), 0, np.int32)),
            seeds=np.asarray([self._request_seed(r) for r in requests] + [[0, 0, 0]] * pad,
                             np.int32))
        return admissions, width

    def _request_seed(self, request: Request) -> list[int]:
        """(kind, a, b) of ``decoding.round.request_keys``: the request's own seed split into
        two 32-bit halves, or the engine's seed and the request id."""
        def int32(value):
            return int(np.uint32(value & 0xFFFFFFFF).view(np.int32))
        if request.seed is None:
            return [0, int32(self.seed), int32(request.id)]
        return [1, int32(request.seed >> 32), int32(request.seed)]

    def _admit(self, pairs: Sequence[tuple[int, Request]], eos_ids=None) -> None:
        eos_ids = self.eos_ids if eos_ids is None else eos_ids
        admissions, width = self._admissions(pairs)
        args = self._models() + (self._slots, self._caches, admissions, eos_ids,
                                 self._temperatures, self._draft_vocab)
        key = ("admit", admissions.slot.shape[0], width, admissions.tokens.shape[0])
        program = self._program(key, step_lib.admit, args, dict(width=width))
        self._slots, self._caches, _ = program(*(a for i, a in enumerate(args) if i not in (0, 2)))

    def compile(self, max_prompt_len: int) -> float:
        """Compiles the current policy's rounds (every cache view) and the one-request
        admissions of every prompt bucket up to ``max_prompt_len`` now (so that serving rarely
        stops to compile); returns seconds spent. Admissions of several requests at once compile
        when first needed."""
        before = self.compile_s
        for view in sorted({cache_view(n, self.max_len) for n in range(1, self.max_len + 1)}):
            key, args, static = self._rounds_program(self.policy, self.policy_params,
                                                     self.eos_ids, view)
            self._program(key, step_lib.run_rounds, args, static)
        lengths = {self._prompt_width(n): n for n in range(max_prompt_len, 0, -1)}
        for width, length in sorted(lengths.items()):
            admissions, width = self._admissions([(0, Request(0, [0] * length, 1))])
            args = self._models() + (self._slots, self._caches, admissions, self.eos_ids,
                                     self._temperatures, self._draft_vocab)
            key = ("admit", 1, width, admissions.tokens.shape[0])
            self._program(key, step_lib.admit, args, dict(width=width))
        return self.compile_s - before

    # -- requests ---------------------------------------------------------------------------

    def check_request(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """The prompt's token ids as a list, if this engine can run the request.

        Raises:
          ValueError: empty prompt, ids outside the vocabulary, max_new_tokens < 1, or a
            prompt + max_new_tokens that does not fit ``max_len``.
        """
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if len(ids) + max_new_tokens > self.max_len:
            raise ValueError(f"prompt of {len(ids)} tokens + max_new_tokens {max_new_tokens} does "
                             f"not fit the slot size max_len={self.max_len}")
        self.target.check_token_ids(np.asarray(ids))
        return ids

    def submit(self, prompt: Sequence[int], *, max_new_tokens: int, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int | None = None) -> Request:
        """Queues a request (token ids); it joins at the next :meth:`step` with a free slot.

        Each request draws from its own PRNG key: from ``seed`` when given, else from the
        engine's seed and the request's id. A seeded request samples the same tokens whenever
        it verifies the same proposal lengths: always without a drafter and under the "full", "fixed"
        and "threshold" policies, whatever runs beside it; under "prefix" and "production" the
        proposal lengths depend on the other requests, and so does the sampled path (not its law).

        Raises:
          ValueError: as :meth:`check_request`.
        """
        ids = self.check_request(prompt, max_new_tokens)
        request = Request(self._next_id, ids, max_new_tokens, float(temperature), float(top_p),
                          int(top_k), None if seed is None else int(seed),
                          submitted_at=time.perf_counter())
        self._next_id += 1
        self._queue.append(request)
        return request

    def abort(self, request: Request) -> bool:
        """Ends ``request`` now (finish_reason "abort"), queued or running: a running request's
        slot is freed for the next admission and keeps the tokens emitted so far. Returns False
        when it had already finished."""
        if request.done:
            return False
        if request in self._queue:
            self._queue.remove(request)
        else:
            slot = next(s for s, r in self._running.items() if r is request)
            active = np.asarray(jax.device_get(self._slots.active)).copy()
            active[slot] = False
            self._set_slots(active=active)
            self._harvest(None)  # its last tokens, then the slot is free
        request.finished_at = time.perf_counter()
        request.finish_reason = "abort"
        return True

    def _admit_queued(self) -> None:
        pairs = []
        while self._queue and self._free:
            request, slot = self._queue.popleft(), self._free.pop(0)
            request.admitted_at = time.perf_counter()
            self._running[slot] = request
            pairs.append((slot, request))
        if pairs:
            self._admit(pairs)

    def _harvest(self, summary: step_lib.RunSummary | None) -> list[Request]:
        """Reads the state back once: new tokens and counters of every running request; frees
        the slots of the finished ones and returns them."""
        s = self._slots
        record = s.trace.proposal_len.shape[1] > 0
        active, generated, output, counters, trace, summary = jax.device_get(
            (s.active, s.generated, s.output, s.counters, s.trace if record else None, summary))
        if summary is not None and int(summary.rounds):
            self.steps += int(summary.rounds)
            self.verified_tokens += int(summary.verified_tokens)
            self.active_slot_steps += int(summary.active_slot_rounds)
            for bucket, count in zip(self.buckets, summary.bucket_counts.tolist()):
                if count:
                    self.bucket_counts[bucket] += count
        now = time.perf_counter()
        finished = []
        for slot, request in list(self._running.items()):
            request.tokens.extend(output[slot, len(request.tokens):generated[slot]].tolist())
            request.counters = row_counters(counters, slot)
            if not active[slot]:
                request.finished_at = now
                request.finish_reason = ("stop" if request.tokens
                                         and request.tokens[-1] in self._eos_set else "length")
                if trace is not None:
                    r = request.counters["rounds"]
                    request.trace = {name: np.asarray(getattr(trace, name)[slot, :r])
                                     for name in ("confidence_logits", "proposal_len",
                                                  "num_accepted")}
                del self._running[slot]
                self._free.append(slot)
                finished.append(request)
        self._free.sort()
        return finished

    def step(self) -> list[Request]:
        """Admits queued requests into free slots (one prefill), runs one round, returns the
        requests that finished. The admission and the round are dispatched back to back and
        read once at the end."""
        self._admit_queued()
        summary = self._run_rounds(1, False) if self._running else None
        return self._harvest(summary)

    def run(self, progress: Callable[[list[Request]], None] | None = None) -> list[Request]:
        """Decodes until every queued and running request finished; returns them in finish order.

        Rounds run on the device without host round trips until a request ends while others
        wait in the queue (then the freed slots are refilled) or everything is done.
        ``progress`` is called with the requests that finished after each engine call."""
        finished = []
        while self.busy:
            self._admit_queued()
            summary = (self._run_rounds(MAX_ROUNDS_PER_CALL, bool(self._queue))
                       if self._running else None)
            done = self._harvest(summary)
            if progress is not None and done:
                progress(done)
            finished.extend(done)
        return finished

    # -- steps/s profile ----------------------------------------------------------------------

    def _profiling_params(self, gamma: int) -> dict:
        """Parameters of the profiling policy: ``gamma`` drafts spread over the active slots."""
        return verification.default_params(spread_drafts, self.num_slots, self.num_proposals,
                                           {"gamma": gamma}, self._temperatures)

    def sps_key(self, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0) -> dict:
        """What the cost of a round depends on: the cache key of its steps/s profile.

        Greedy rounds skip the probability rows and the random draws, and truncated sampling
        sorts the vocabulary, so the sampling mode is part of the key. ``program`` hashes the
        profiled program's StableHLO, so a change to the round's code, or to anything it is
        traced with, measures a new profile; ``kernels`` the CPU kernels' builds
        (``cpu_kernels.registered``, which the StableHLO names only by target), ``jax`` the
        compiler."""
        if self.drafter is None:
            raise ValueError("a steps/s profile needs a drafter (it sizes speculative verification)")
        cfg, dcfg = self.target.config, self.drafter.config
        model = self.target.name or (f"{cfg.model_type}-L{cfg.num_hidden_layers}-d{cfg.hidden_size}"
                                     f"-V{cfg.vocab_size}")
        key, args, static = self._rounds_program(spread_drafts, self._profiling_params(0),
                                                 jnp.asarray([-1], jnp.int32), self.max_len)
        program = _PROGRAMS.fingerprint(self._structure() + key, step_lib.run_rounds, args, static)
        return dict(model=model, dtype=str(np.dtype(self.target.dtype)),
                    device_kind=jax.devices()[0].device_kind, buckets=list(self.buckets),
                    slots=self.num_slots, max_len=self.max_len,
                    sampling=sampling_mode(temperature, top_p, top_k),
                    drafter=dict(layers=dcfg.num_layers, block_size=dcfg.block_size,
                                 head=dcfg.head, markov_rank=dcfg.markov_rank),
                    program=program, kernels=list(cpu_kernels.registered()),
                    jax=jax.__version__)

    def profile_sps(self, *, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                    repeats: int = 10, warmup: int = 3, refresh: bool = False,
                    cache: bool = True, progress: Callable[[str], None] | None = None
                    ) -> sps_lib.SPSProfile:
        """Measures steps/s of this engine's round at every token bucket B (cached).

        Profile with the sampling parameters of the load the table will schedule: a greedy
        round costs less than a sampled one. A cached profile is used only when its key
        (:meth:`sps_key`, including the hash of the program) is the current one.

        A round is timed whole (policy, flat verify forward of B tokens, rejection sampling,
        draft of all S slots, host read of its summary): min(B, S) slots are active and
        B - min(B, S) drafts are spread over them, and the attention reads the whole cache (the
        widest view: the table errs on the slow side). The engine must be idle; its slots are
        left free.
        """
        if self.busy:
            raise RuntimeError("profile_sps needs an idle engine")

        def measure():
            no_eos = jnp.asarray([-1], jnp.int32)
            prompt = [0] * min(8, self.max_len - 1)
            fill = [(slot, Request(0, prompt, self.max_len - len(prompt), temperature, top_p,
                                   top_k)) for slot in range(self.num_slots)]
            self._admit(fill, no_eos)
            start_pos = np.full((self.num_slots,), len(prompt), np.int32)

            def time_step(tokens: int) -> float:
                active = np.arange(self.num_slots) < min(tokens, self.num_slots)
                self._set_slots(active=active, anchor_pos=start_pos,
                                generated=np.ones_like(start_pos))
                params = self._profiling_params(tokens - min(tokens, self.num_slots))
                start = time.perf_counter()
                summary = jax.device_get(self._run_rounds(1, False, spread_drafts, params, no_eos,
                                                          view=self.max_len))
                seconds = time.perf_counter() - start
                assert int(summary.verified_tokens) == tokens, (int(summary.verified_tokens), tokens)
                return seconds

            try:
                return sps_lib.measure_grid(time_step, self.buckets, repeats=repeats,
                                            warmup=warmup, progress=progress)
            finally:
                self._set_slots(active=np.zeros((self.num_slots,), bool))

        return sps_lib.cached_profile(self.sps_key(temperature, top_p, top_k), measure,
                                      refresh=refresh, cache=cache)

    def _set_slots(self, **fields: np.ndarray) -> None:
        """Sets slot fields from host values, placed like the current ones (their shardings)."""
        self._slots = self._slots.replace(**{
            name: jax.device_put(value, getattr(self._slots, name).sharding)
            for name, value in fields.items()})

