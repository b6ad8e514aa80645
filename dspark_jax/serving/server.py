"""``dspark-jax serve``: an OpenAI-compatible HTTP server on the one engine.

The server is an online client of the engine, as ``generate`` is an offline one: FastAPI
handlers (the event loop) validate a request, template and tokenize it, and hand it to the
:class:`~dspark_jax.serving.worker.EngineWorker`, whose thread runs continuous batching with
the scheduler choosing each round's proposal lengths. Deltas come back per engine step and are
streamed as server-sent events (``data: {...}`` chunks, then ``data: [DONE]``) or joined into
one response.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /health``, ``GET /metrics`` (Prometheus). Bad input gets a 4xx with OpenAI's error body
naming the problem (400 invalid request, 404 unknown model, 429 queue full); a client that
disconnects has its request aborted and its slot freed.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark_jax.prompts import messages_ids
from dspark_jax.serving import metrics
from dspark_jax.serving.protocol import (ChatCompletionRequest, CompletionRequest, SamplingRequest,
                                         error_body)
from dspark_jax.serving.text import TextStream
from dspark_jax.serving.worker import EngineWorker, QueueFull, Stream

# How often a non-streaming request checks that its client is still connected (seconds).
DISCONNECT_POLL_S = 0.25


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, error_body(message, kind=kind, param=param, code=code)


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) of the first validation error, e.g. "temperature: Input should be less
    than or equal to 2"."""
    first = error.errors()[0] if error.errors() else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    msg = first.get("msg", "invalid request").removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', msg)}", None
    if first.get("type") == "missing":
        return f"{'.'.join(loc)}: required", loc[0] if loc else None
    param = loc[0] if loc else None
    text = f"{'.'.join(loc)}: {msg}" if loc and not msg.startswith(f"{loc[0]}:") else msg
    return text, param


def build_app(worker: EngineWorker, *, model_name: str, tokenizer) -> FastAPI:
    """The FastAPI application serving ``worker``'s engine as ``model_name``."""
    app = FastAPI(title="dspark-jax", description=__doc__)
    engine = worker.engine
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_, error: APIError):
        return JSONResponse(error.body, status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, error: RequestValidationError):
        message, param = _validation_message(error)
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, error: StarletteHTTPException):
        return JSONResponse(error_body(str(error.detail), code=str(error.status_code)),
                            status_code=error.status_code)

    @app.get("/health")
    async def health():
        if not worker.alive:
            raise APIError(503, f"the engine stopped: {worker.error!r}", kind="server_error")
        return {"status": "ok", "slots": engine.num_slots, "slots_in_use": worker.slots_in_use,
                "queue_length": worker.queue_length}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(worker, model_name),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": created, "owned_by": "dspark-jax",
                                            "max_model_len": engine.max_len}]}

    def check_model(body: SamplingRequest) -> None:
        if body.model != model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                           f"{model_name!r} (GET /v1/models)", param="model",
                           code="model_not_found")

    def start(prompt: list[int], body: SamplingRequest, limit: int | None) -> Stream:
        room = engine.max_len - len(prompt)
        if room < 1:
            raise APIError(400, f"the prompt has {len(prompt)} tokens; this server's context is "
                           f"{engine.max_len} tokens", param="messages")
        try:
            return worker.submit(prompt, max_new_tokens=room if limit is None else limit,
                                 temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                 seed=body.seed)
        except QueueFull as error:
            raise APIError(429, str(error), kind="rate_limit_error", code="queue_full") from None
        except ValueError as error:
            raise APIError(400, str(error), param="max_tokens") from None
        except RuntimeError as error:
            raise APIError(503, str(error), kind="server_error") from None

    async def deltas(stream: Stream, text: TextStream) -> AsyncIterator[tuple[str, str | None]]:
        """(text delta, finish reason or None) per engine step until the request ends; a stop
        string ends it early (the engine request is aborted, the reason is "stop")."""
        while True:
            delta = await stream.queue.get()
            if delta.finish_reason == "error":
                raise APIError(500, f"the engine stopped: {worker.error!r}", kind="server_error")
            piece = text.add(delta.tokens)
            if text.stopped:
                worker.abort(stream)
                yield piece, "stop"
                return
            if delta.finish_reason is not None:
                yield piece + text.flush(), delta.finish_reason
                return
            if piece:
                yield piece, None

    async def collect(stream: Stream, text: TextStream, http: Request) -> str | None:
        """Runs the request to its end (its finish reason); None, with the request aborted, when
        the client disconnected first (checked every DISCONNECT_POLL_S meanwhile)."""
        async def finish():
            async for _, reason in deltas(stream, text):
                if reason is not None:
                    return reason

        async def disconnected():
            while not await http.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)

        run, watch = asyncio.ensure_future(finish()), asyncio.ensure_future(disconnected())
        await asyncio.wait([run, watch], return_when=asyncio.FIRST_COMPLETED)
        if run.done():
            watch.cancel()
            return run.result()
        run.cancel()
        worker.abort(stream)
        return None

    def usage(stream: Stream, completion_tokens: int) -> dict:
        return {"prompt_tokens": len(stream.prompt), "completion_tokens": completion_tokens,
                "total_tokens": len(stream.prompt) + completion_tokens}

    def sse(payload) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    async def respond(http: Request, body: SamplingRequest, prompt: list[int], limit: int | None,
                      chat: bool):
        stream = start(prompt, body, limit)
        text = TextStream(tokenizer, body.stop_strings)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": model_name}

        def choice(piece: str, reason: str | None, streaming: bool) -> dict:
            if not chat:
                return {"index": 0, "text": piece, "logprobs": None, "finish_reason": reason}
            key = "delta" if streaming else "message"
            message = {"role": "assistant", "content": piece} if not streaming or piece else {}
            return {"index": 0, key: message, "logprobs": None, "finish_reason": reason}

        if not body.stream:
            reason = await collect(stream, text, http)
            if reason is None:
                return PlainTextResponse("", status_code=499)  # nobody is listening
            return dict(head, choices=[choice(text.text, reason, False)],
                        usage=usage(stream, len(stream.request.tokens)))

        chunk_head = dict(head, object="chat.completion.chunk" if chat else "text_completion")

        async def events():
            try:
                if chat:  # the role first, as OpenAI does
                    yield sse(dict(chunk_head, choices=[{"index": 0, "delta": {
                        "role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}]))
                async for piece, reason in deltas(stream, text):
                    yield sse(dict(chunk_head, choices=[choice(piece, reason, True)]))
                if body.include_usage:
                    yield sse(dict(chunk_head, choices=[],
                                   usage=usage(stream, len(stream.request.tokens))))
                yield "data: [DONE]\n\n"
            except APIError as error:
                yield sse(error.body)
            finally:  # a disconnected client cancels this generator: free the slot
                if not stream.finished:
                    worker.abort(stream)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        check_model(body)
        if isinstance(body.prompt, str):
            prompt = list(tokenizer(body.prompt)["input_ids"])
        else:
            prompt = list(body.prompt)
        return await respond(http, body, prompt, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        check_model(body)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text}
                    for m in body.messages]
        return await respond(http, body, messages_ids(tokenizer, messages), body.token_limit,
                             chat=True)

    return app
