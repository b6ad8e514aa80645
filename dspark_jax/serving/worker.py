"""The engine's own thread: an online client of the one engine for an asyncio server.

:class:`EngineWorker` owns an ``engine.Engine`` and is the only thread that touches it. The
server's event loop calls :meth:`EngineWorker.submit` (thread-safe) and reads the request's
:class:`Stream`, an ``asyncio.Queue`` of :class:`Delta` s; the worker admits submissions
between steps, runs one engine step (one round over every slot) at a time, and after each step
hands every running request its new tokens. :meth:`EngineWorker.abort` (a disconnected client,
a stop string) ends a request and frees its slot before the next step. A bounded queue refuses
new requests while ``max_queue`` wait for a slot (:class:`QueueFull`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Sequence

from dspark_jax.engine import Engine, Request
from dspark_jax.engine.stats import sum_counters


class QueueFull(RuntimeError):
    """The worker's queue holds ``max_queue`` requests waiting for a slot."""


@dataclasses.dataclass(frozen=True)
class Delta:
    """New tokens of a request since its previous delta; the last one has ``finish_reason``."""

    tokens: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort" on the last delta


@dataclasses.dataclass
class Stream:
    """One submitted request as the event loop sees it."""

    prompt: list[int]
    queue: asyncio.Queue  # of Delta
    loop: asyncio.AbstractEventLoop
    request: Request | None = None  # set by the worker once the engine has it
    sent: int = 0  # tokens handed out so far (worker thread only)
    finished: bool = False


@dataclasses.dataclass
class ServingCounters:
    """Totals since the worker started (read by the metrics endpoint)."""

    requests_finished: int = 0
    requests_aborted: int = 0
    requests_rejected: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    step_seconds: float = 0.0  # compilation included
    compile_seconds: float = 0.0
    verified_tokens: int = 0
    speculative: dict | None = None  # engine.stats counters summed over finished requests


class EngineWorker:
    """Runs ``engine`` in a daemon thread until :meth:`close`.

    Args:
      engine: an idle Engine, used by this worker only from now on.
      max_queue: requests that may wait for a slot; one more raises :class:`QueueFull`.
    """

    def __init__(self, engine: Engine, *, max_queue: int):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.engine, self.max_queue = engine, max_queue
        self.counters = ServingCounters()
        self._lock = threading.Condition()
        self._incoming: list[tuple[Stream, dict]] = []
        self._aborts: list[Stream] = []
        self._streams: dict[int, Stream] = {}  # request id -> stream, while the engine has it
        self._closed = False
        self.error: BaseException | None = None  # what stopped the thread, if anything
        self._thread = threading.Thread(target=self._loop, name="dspark-engine", daemon=True)
        self._thread.start()

    # -- event-loop side ----------------------------------------------------------------------

    @property
    def queue_length(self) -> int:
        """Requests waiting for a slot (submitted, not admitted)."""
        return len(self._incoming) + self.engine.queue_length

    @property
    def slots_in_use(self) -> int:
        return self.engine.slots_in_use

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, prompt: Sequence[int], *, max_new_tokens: int, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int | None = None) -> Stream:
        """Queues a request; its deltas arrive on the returned stream's queue (call from the
        event loop). The request is checked here (``Engine.check_request``), so bad input raises
        ValueError before anything is queued.

        Raises:
          QueueFull: ``max_queue`` requests are waiting for a slot.
          ValueError: an empty prompt, ids outside the vocabulary, or one that does not fit.
          RuntimeError: the worker has stopped.
        """
        params = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                      top_k=top_k, seed=seed)
        prompt = self.engine.check_request(prompt, max_new_tokens)
        stream = Stream(prompt, asyncio.Queue(), asyncio.get_running_loop())
        with self._lock:
            if self._closed or not self.alive:
                raise RuntimeError(f"the engine worker has stopped ({self.error!r})")
            if self.queue_length >= self.max_queue:
                self.counters.requests_rejected += 1
                raise QueueFull(f"the queue is full: {self.queue_length} requests wait for one "
                                f"of {self.engine.num_slots} slots (--max-queue "
                                f"{self.max_queue}); retry later")
            self._incoming.append((stream, params))
            self._lock.notify()
        return stream

    def abort(self, stream: Stream) -> None:
        """Ends the stream's request before the next step (its slot is freed); its last delta
        has finish_reason "abort" unless it had finished already. Thread-safe."""
        with self._lock:
            self._aborts.append(stream)
            self._lock.notify()

    def close(self, timeout: float = 30.0) -> None:
        """Stops the thread after the current step; waiting requests end with "abort"."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout)

    # -- worker thread ------------------------------------------------------------------------

    def _publish(self, stream: Stream, finish_reason: str | None = None) -> None:
        tokens = stream.request.tokens if stream.request is not None else []
        new = list(tokens[stream.sent:])
        stream.sent = len(tokens)
        if new or finish_reason is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, Delta(new, finish_reason))

    def _finish(self, stream: Stream) -> None:
        request = stream.request
        stream.finished = True
        self._streams.pop(request.id, None)
        c = self.counters
        c.generation_tokens += len(request.tokens)
        if request.finish_reason == "abort":
            c.requests_aborted += 1
        else:
            c.requests_finished += 1
        if request.counters:
            c.speculative = sum_counters([request.counters] + ([c.speculative] if c.speculative
                                                                else []))
        self._publish(stream, request.finish_reason)

    def _take_commands(self) -> bool:
        """Moves submissions into the engine and carries out aborts; False once closed."""
        with self._lock:
            while not (self._incoming or self._aborts or self._closed or self.engine.busy):
                self._lock.wait()
            for stream, params in self._incoming:  # under the lock: queue_length stays exact
                stream.request = self.engine.submit(stream.prompt, **params)
                self._streams[stream.request.id] = stream
                self.counters.prompt_tokens += len(stream.prompt)
            self._incoming.clear()
            aborts, self._aborts = self._aborts, []
            closed = self._closed
        for stream in aborts:
            if stream.finished:
                continue
            if stream.request is None:  # aborted before it reached the engine
                stream.finished = True
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, Delta([], "abort"))
            elif self.engine.abort(stream.request):
                self._finish(stream)
        if closed:
            for stream in list(self._streams.values()):
                if self.engine.abort(stream.request):
                    self._finish(stream)
        return not closed

    def _loop(self) -> None:
        try:
            while self._take_commands():
                if not self.engine.busy:
                    continue
                before = self.engine.steps
                start = time.perf_counter()
                finished = self.engine.step()
                seconds = time.perf_counter() - start
                c = self.counters
                c.steps += self.engine.steps - before
                c.step_seconds += seconds
                c.compile_seconds = self.engine.compile_s
                c.verified_tokens = self.engine.verified_tokens
                for request in finished:
                    self._finish(self._streams[request.id])
                for stream in self._streams.values():
                    self._publish(stream)
        except BaseException as error:  # noqa: BLE001 -- reported to every waiting request
            self.error = error
            for stream in list(self._streams.values()):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, Delta([], "error"))
            raise
