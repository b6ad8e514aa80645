"""The OpenAI HTTP API's request bodies and error body (the subset the server implements).

Fields the server does not implement but OpenAI clients send by default are accepted and
ignored; fields that would change the output and are not implemented (``n`` > 1, ``logprobs``,
``echo``, ``best_of`` > 1, penalties) are refused with a message rather than silently ignored.
``top_k`` is an extension, as in vLLM.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_STOP_STRINGS = 4


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @model_validator(mode="after")
    def _check_sampling(self):
        if self.n != 1:
            raise ValueError(f"n: one choice per request is supported, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name}: not implemented (send 0)")
        stops = self.stop_strings
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop: strings must be non-empty")
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None

    @model_validator(mode="after")
    def _check_prompt(self):
        for name, unset in (("logprobs", None), ("echo", False), ("best_of", None)):
            if getattr(self, name) not in (unset, 1 if name == "best_of" else unset):
                raise ValueError(f"{name}: not implemented")
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("prompt: one prompt per request (send several requests)")
            self.prompt = prompt[0]
        if not self.prompt or (isinstance(self.prompt, str) and not self.prompt.strip()):
            raise ValueError("prompt: empty")
        return self


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(
            part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``: a conversation, rendered by the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False

    @model_validator(mode="after")
    def _check_messages(self):
        if self.logprobs:
            raise ValueError("logprobs: not implemented")
        if not any(m.text.strip() for m in self.messages):
            raise ValueError("messages: every message is empty")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
