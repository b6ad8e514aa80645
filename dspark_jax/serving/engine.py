"""The continuous-batching serving engine: a host loop around the jitted step and admission.

``Engine(target, drafter, slots=S, max_len=N)`` owns S slots with their KV cache rows. Requests
are queued by :meth:`Engine.submit`; each :meth:`Engine.step` first prefills queued requests
into free slots, then runs one decode step over all slots (``serving/step.py``) and returns the
requests that finished. Callers drive the loop, so requests can arrive at any step (see
``serving/loadgen.py`` for a closed-loop load generator).

Compiled programs: one decode step per verification policy (and SPS table length; its verify
forward is a ``lax.switch`` over the token buckets) and one admission per prompt bucket;
sampling settings, policy parameters and the SPS table's values are traced, so changing them
never recompiles. Under ``jax.set_mesh`` (with the models loaded under the same mesh) the
engine runs data parallel over slots and tensor parallel over heads: cache rows are sharded
over the data axes, kv heads over the tensor axis, and the small slot state is replicated.
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

from dspark_jax.decoding import verification
from dspark_jax.decoding.sampling import GREEDY_TEMPERATURE
from dspark_jax.generation import prompt_bucket
from dspark_jax.models.kv_cache import KVCache
from dspark_jax.scheduling import sps as sps_lib
from dspark_jax.serving import step as step_lib


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
    tokens: list[int] = dataclasses.field(default_factory=list)  # generated, EOS included
    rounds: int = 0  # decode steps the request took part in
    tau_sum: int = 0
    accepted: int = 0
    proposed: int = 0  # draft tokens verified (sum of its budgets)
    submitted_at: float = 0.0
    admitted_at: float | None = None
    finished_at: float | None = None

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    @property
    def tau(self) -> float | None:
        return self.tau_sum / self.rounds if self.rounds else None


def token_buckets(slots: int, proposals: int,
                  buckets: Sequence[int] | None = None) -> tuple[int, ...]:
    """Flat token counts of the verify forward, sorted, the last one S * (P + 1).

    Default: the powers of two below S * (P + 1), e.g. (1, 2, 4, ..., 256, 512) for 64 slots and
    7 proposals. A step runs with the smallest bucket >= its verified tokens.
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


def machine_sps_table(target, drafter, *, slots: int, prompt_len: int, max_new_tokens: int,
                      temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0) -> np.ndarray:
    """This machine's steps/s table float32 [slots * (P + 1) + 1] by forward tokens, for
    ``slots`` requests of prompts up to ``prompt_len`` tokens and ``max_new_tokens``: the
    profile of the serving step (:meth:`Engine.profile_sps`, cache rows rounded up to a
    multiple of 256 so that similar runs share it), measured once per key and then read from
    the cache. It also serves ``generate``'s static batch of ``slots`` rows, whose verify of
    b x T tokens does the same projection, MLP and LM-head work."""
    cache = prompt_bucket(prompt_len) + max_new_tokens + drafter.num_proposals + 1
    engine = Engine(target, drafter, slots=slots, max_len=-(-cache // 256) * 256)
    return engine.profile_sps(temperature=temperature, top_p=top_p, top_k=top_k).table()


class Engine:
    """Continuous batching with S slots over a target and its drafter.

    Args:
      target: a loaded Target; drafter: a Drafter of ``target`` (trained or not).
      slots: S, the number of requests decoded together.
      max_len: N, cache slots per request: prompt + max_new_tokens must fit.
      policy, policy_params: the verification policy (``verification.POLICIES`` or a function)
        and its parameters, e.g. {"gamma": 2} or {"sps": table}; see :meth:`set_policy`.
      buckets: flat token counts of the verify forward (default :func:`token_buckets`).
      seed: PRNG seed of the sampling.
    """

    def __init__(self, target, drafter, *, slots: int, max_len: int, policy="full",
                 policy_params: dict | None = None, buckets: Sequence[int] | None = None,
                 seed: int = 0):
        if drafter.target is not target:
            raise ValueError("the drafter was built for another target object")
        if slots < 1 or max_len < 2:
            raise ValueError(f"need slots >= 1 and max_len >= 2, got {slots} and {max_len}")
        self.target, self.drafter = target, drafter
        self.num_slots, self.max_len = slots, max_len
        self.proposals = drafter.num_proposals
        # The drafter's STS temperatures (``Drafter.calibrate``) as of engine creation.
        self._temperatures = (np.ones((self.proposals,), np.float32)
                              if drafter.confidence_temperatures is None
                              else np.asarray(drafter.confidence_temperatures, np.float32))
        self.buckets = token_buckets(slots, self.proposals, buckets)
        self.eos_ids = jnp.asarray(target.eos_token_ids or (-1,), jnp.int32)
        self._key, step_key = jax.random.split(jax.random.key(seed))
        self._programs: dict = {}  # key -> compiled program
        self._lowered: dict = {}  # key -> lowered program not compiled yet
        self._fingerprints: dict = {}  # key -> hash of the program's StableHLO
        self.compile_s = 0.0
        self.set_policy(policy, policy_params)
        cfg = target.config

        def empty_state(key):
            caches = step_lib.Caches(
                KVCache.zeros(cfg.num_hidden_layers, slots, max_len, cfg.num_key_value_heads,
                              cfg.head_dim, target.dtype),
                drafter.model.init_cache(slots, max_len))
            return step_lib.laid_out(
                step_lib.Slots.empty(slots, self.proposals, cfg.vocab_size, key), caches)

        # Under jax.set_mesh the state is laid out over the mesh (step_lib.laid_out); every leaf
        # is its own buffer, so the state can be donated.
        self._slots, self._caches = jax.jit(empty_state)(step_key)
        self._free = list(range(slots))
        self._running: dict[int, Request] = {}
        self._queue: collections.deque[Request] = collections.deque()
        self._next_id = 0
        self.reset_stats()

    # -- configuration ---------------------------------------------------------------------

    def set_policy(self, policy, policy_params: dict | None = None) -> None:
        """Chooses the verification policy of the next steps.

        ``"prefix"`` and ``"production"`` read a steps/s table {"sps": [...]} indexed by flat
        verify tokens (:meth:`profile_sps`); without one they see a flat table.

        Raises:
          ValueError: an unknown policy or parameter.
        """
        self.policy_params = verification.default_params(policy, self.num_slots, self.proposals,
                                                          policy_params, self._temperatures)
        self.policy = policy

    def reset_stats(self) -> None:
        """Zeroes the engine counters (steps, verified tokens, bucket use)."""
        self.steps = 0
        self.verified_tokens = 0
        self.active_slot_steps = 0
        self.bucket_counts = collections.Counter()

    @property
    def num_compiled(self) -> int:
        """Programs compiled so far (decode steps per policy + admissions per prompt bucket)."""
        return len(self._programs)

    @property
    def busy(self) -> bool:
        return bool(self._queue or self._running)

    # -- programs ---------------------------------------------------------------------------

    def _lower(self, fn, args, **static):
        start = time.perf_counter()
        jitted = jax.jit(fn, static_argnums=(0, 2), static_argnames=tuple(static),
                         donate_argnums=(4, 5))
        lowered = jitted.lower(*args, **static)
        self.compile_s += time.perf_counter() - start
        return lowered

    def _compiled(self, key, fn, args, **static):
        if key not in self._programs:
            lowered = self._lowered.pop(key, None)
            if lowered is None:
                lowered = self._lower(fn, args, **static)
            start = time.perf_counter()
            self._programs[key] = lowered.compile()
            self.compile_s += time.perf_counter() - start
        return self._programs[key]

    def _fingerprint(self, key, fn, args, **static) -> str:
        """16 hex digits of the sha256 of the program's StableHLO text: it changes whenever the
        computation does (code, shapes, dtypes, shardings), and only then."""
        if key not in self._fingerprints:
            lowered = self._lower(fn, args, **static)
            if key not in self._programs:
                self._lowered[key] = lowered  # compiled from it later, not lowered twice
            text = lowered.as_text()
            self._fingerprints[key] = hashlib.sha256(text.encode()).hexdigest()[:16]
        return self._fingerprints[key]

    def _models(self):
        return (self.target.graphdef, self.target.state, self.drafter.graphdef, self.drafter.state)

    def _step_program(self, policy, policy_params, eos_ids):
        """(program key, args, static args) of the decode step under ``policy``."""
        args = self._models() + (self._slots, self._caches, eos_ids, policy_params)
        key = ("step", policy, policy_params["sps"].shape[0])
        return key, args, dict(buckets=self.buckets, policy=policy)

    def _run_step(self, policy, policy_params, eos_ids) -> step_lib.StepOutput:
        key, args, static = self._step_program(policy, policy_params, eos_ids)
        program = self._compiled(key, step_lib.decode_step, args, **static)
        dynamic = (a for i, a in enumerate(args) if i not in (0, 2))
        self._slots, self._caches, out = program(*dynamic)
        return out

    def _like_slots(self, **fields: np.ndarray) -> dict:
        """Host values for slot fields, placed like the current ones (their shardings)."""
        return {name: jax.device_put(value, getattr(self._slots, name).sharding)
                for name, value in fields.items()}

    def _prompt_width(self, length: int) -> int:
        return min(prompt_bucket(length), self.max_len)

    def _admission(self, slot: int, request: Request) -> step_lib.Admission:
        """The admission pytree of ``request``: its prompt padded to the prompt bucket."""
        width = self._prompt_width(len(request.prompt))
        tokens = np.zeros((width,), np.int32)
        tokens[:len(request.prompt)] = request.prompt
        return step_lib.Admission(np.int32(slot), tokens, np.int32(len(request.prompt)),
                                  np.int32(request.max_new_tokens), np.float32(request.temperature),
                                  np.float32(request.top_p), np.int32(request.top_k), self._key,
                                  np.int32(request.id), self._temperatures)

    def _run_admit(self, admission, eos_ids):
        args = self._models() + (self._slots, self._caches, admission, eos_ids)
        program = self._compiled(("admit", admission.tokens.shape[0]), step_lib.admit, args)
        dynamic = (a for i, a in enumerate(args) if i not in (0, 2))
        self._slots, self._caches, first, done = program(*dynamic)
        return first, done

    def compile(self, max_prompt_len: int) -> float:
        """Compiles the current policy's step and the admissions of every prompt bucket up to
        ``max_prompt_len`` now (so that serving never stops to compile); returns seconds spent."""
        before = self.compile_s
        key, args, static = self._step_program(self.policy, self.policy_params, self.eos_ids)
        self._compiled(key, step_lib.decode_step, args, **static)
        lengths = {self._prompt_width(n): n for n in range(max_prompt_len, 0, -1)}
        for width, length in sorted(lengths.items()):
            request = Request(0, [0] * length, 1)
            args = self._models() + (self._slots, self._caches, self._admission(0, request),
                                     self.eos_ids)
            self._compiled(("admit", width), step_lib.admit, args)
        return self.compile_s - before

    # -- serving ----------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], *, max_new_tokens: int, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0) -> Request:
        """Queues a request (token ids); it joins at the next :meth:`step` with a free slot.

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
        request = Request(self._next_id, ids, max_new_tokens, float(temperature), float(top_p),
                          int(top_k), submitted_at=time.perf_counter())
        self._next_id += 1
        self._queue.append(request)
        return request

    def step(self) -> list[Request]:
        """Admits queued requests into free slots, runs one decode step, returns finished ones.

        The admissions and the step are dispatched back to back and read once at the end."""
        admitted = []
        while self._queue and self._free:
            request, slot = self._queue.popleft(), self._free.pop(0)
            request.admitted_at = time.perf_counter()
            admitted.append((slot, request, self._run_admit(self._admission(slot, request),
                                                            self.eos_ids)))
            self._running[slot] = request
        out = None
        if self._running:
            out = self._run_step(self.policy, self.policy_params, self.eos_ids)
        firsts, out = jax.device_get(([a[2] for a in admitted], out))
        now = time.perf_counter()
        finished = []

        def finish(slot, request):
            request.finished_at = now
            del self._running[slot]
            self._free.append(slot)
            finished.append(request)

        for (slot, request, _), (first, done) in zip(admitted, firsts):
            request.tokens.append(int(first))
            if done:  # EOS or max_new_tokens 1: the slot was inactive during the step
                finish(slot, request)
        if out is not None and self._running:
            self.steps += 1
            self.verified_tokens += int(out.verified_tokens)
            self.active_slot_steps += len(self._running)
            self.bucket_counts[self.buckets[int(out.bucket)]] += 1
        for slot, request in list(self._running.items()):
            request.tokens.extend(out.emitted[slot, :out.num_emitted[slot]].tolist())
            request.rounds += 1
            request.tau_sum += int(out.tau[slot])
            request.accepted += int(out.accepted[slot])
            request.proposed += int(out.num_draft[slot])
            if out.finished[slot]:
                finish(slot, request)
        self._free.sort()
        return finished

    def run(self) -> list[Request]:
        """Steps until every queued and running request finished; returns them in finish order."""
        finished = []
        while self.busy:
            finished.extend(self.step())
        return finished

    # -- steps/s profile ----------------------------------------------------------------------

    def _profiling_params(self, gamma: int) -> dict:
        """Parameters of the profiling policy: ``gamma`` drafts spread over the active slots."""
        return verification.default_params(spread_drafts, self.num_slots, self.proposals,
                                           {"gamma": gamma}, self._temperatures)

    def sps_key(self, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0) -> dict:
        """What the cost of a step depends on: the cache key of its steps/s profile.

        Greedy steps skip the probability rows and the random draws, and truncated sampling
        sorts the vocabulary, so the sampling mode is part of the key. ``program`` hashes the
        profiled step's StableHLO (:meth:`_fingerprint`), so a change to the step's code, or to
        anything it is traced with, measures a new profile; ``jax`` covers the compiler."""
        cfg, dcfg = self.target.config, self.drafter.config
        model = self.target.name or (f"{cfg.model_type}-L{cfg.num_hidden_layers}-d{cfg.hidden_size}"
                                     f"-V{cfg.vocab_size}")
        key, args, static = self._step_program(spread_drafts, self._profiling_params(0),
                                               jnp.asarray([-1], jnp.int32))
        program = self._fingerprint(key, step_lib.decode_step, args, **static)
        return dict(model=model, dtype=str(np.dtype(self.target.dtype)),
                    device_kind=jax.devices()[0].device_kind, buckets=list(self.buckets),
                    slots=self.num_slots, max_len=self.max_len,
                    sampling=sampling_mode(temperature, top_p, top_k),
                    drafter=dict(layers=dcfg.num_layers, block_size=dcfg.block_size,
                                 head=dcfg.head, markov_rank=dcfg.markov_rank),
                    program=program, jax=jax.__version__)

    def profile_sps(self, *, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                    repeats: int = 10, warmup: int = 3, refresh: bool = False,
                    cache: bool = True, progress: Callable[[str], None] | None = None
                    ) -> sps_lib.SPSProfile:
        """Measures steps/s of this engine's decode step at every token bucket B (cached).

        Profile with the sampling parameters of the load the table will schedule: a greedy
        step costs less than a sampled one. A cached profile is used only when its key
        (:meth:`sps_key`, including the hash of the step program) is the current one.

        A step is timed whole (policy, flat verify forward of B tokens, rejection sampling,
        draft step of all S slots, host read of its output): min(B, S) slots are active and
        B - min(B, S) drafts are spread over them. The engine must be idle; its slots are left
        free.
        """
        if self.busy:
            raise RuntimeError("profile_sps needs an idle engine")

        def measure():
            prompt = [0] * min(8, self.max_len - 1)
            for slot in range(self.num_slots):
                request = Request(0, prompt, self.max_len - len(prompt), temperature, top_p, top_k)
                self._run_admit(self._admission(slot, request), jnp.asarray([-1], jnp.int32))
            no_eos = jnp.asarray([-1], jnp.int32)
            start_pos = np.full((self.num_slots,), len(prompt), np.int32)

            def time_step(tokens: int) -> float:
                active = np.arange(self.num_slots) < min(tokens, self.num_slots)
                self._slots = self._slots.replace(**self._like_slots(
                    active=active, anchor_pos=start_pos, generated=np.ones_like(start_pos)))
                params = self._profiling_params(tokens - min(tokens, self.num_slots))
                start = time.perf_counter()
                out = jax.device_get(self._run_step(spread_drafts, params, no_eos))
                seconds = time.perf_counter() - start
                assert int(out.verified_tokens) == tokens, (int(out.verified_tokens), tokens)
                return seconds

            try:
                return sps_lib.measure_grid(time_step, self.buckets, repeats=repeats,
                                            warmup=warmup, progress=progress)
            finally:
                self._slots = self._slots.replace(
                    **self._like_slots(active=np.zeros((self.num_slots,), bool)))

        return sps_lib.cached_profile(self.sps_key(temperature, top_p, top_k), measure,
                                      refresh=refresh, cache=cache)
