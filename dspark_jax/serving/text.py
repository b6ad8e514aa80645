"""Tokens to streamed text: incremental detokenization with stop strings.

:class:`TextStream` turns a request's token deltas into text deltas. It decodes the whole
token list each time (skipping special tokens, as ``generate`` does), so the joined deltas
equal the decoded text; a trailing incomplete UTF-8 sequence (decoded as U+FFFD) waits for its
next bytes, and the last ``len(longest stop string) - 1`` characters wait until they cannot
begin a stop string. When a stop string appears the text ends just before it.
"""

from __future__ import annotations

from typing import Sequence

REPLACEMENT = "\ufffd"


class TextStream:
    """Text deltas of one request.

    Args:
      tokenizer: a transformers tokenizer.
      stop: strings that end the text (not included in it).
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""  # the text so far, cut before a stop string once one appeared
        self.sent = 0  # characters handed out
        self.stopped = False  # a stop string appeared

    def add(self, tokens: Sequence[int]) -> str:
        """The text delta that ``tokens`` (the request's next tokens) release."""
        if self.stopped or not tokens:
            return ""
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = min((i for i in (text.find(s, max(self.sent - self._hold, 0)) for s in self.stop)
                   if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = text[:cut], True
            return self.flush()
        self.text = text
        ready = len(text.rstrip(REPLACEMENT)) if text.endswith(REPLACEMENT) else len(text)
        ready = max(min(ready, len(text) - self._hold), self.sent)
        delta, self.sent = text[self.sent:ready], ready
        return delta

    def flush(self) -> str:
        """The text not handed out yet (at the end of the request)."""
        delta, self.sent = self.text[self.sent:], len(self.text)
        return delta
