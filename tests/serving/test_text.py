"""Incremental detokenization (``serving/text.py``) with SmolLM2's byte-level BPE tokenizer."""

import pytest

from dspark_jax.serving.text import TextStream


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2.tokenizer


def stream_pieces(tokenizer, ids, stop=(), step=1):
    text = TextStream(tokenizer, stop)
    pieces = [text.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    return pieces + [text.flush()], text


@pytest.mark.parametrize("step", [1, 3])
def test_deltas_join_to_the_decoded_text_and_never_split_a_character(tokenizer, step):
    sample = "Café ☕ costs 3€ — naïve 你好 🎉🎉 done."
    ids = tokenizer(sample)["input_ids"]
    pieces, text = stream_pieces(tokenizer, ids, step=step)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == text.text
    assert not any("\ufffd" in piece for piece in pieces)
    assert sum(1 for p in pieces if p) > 5  # it streams


def test_a_stop_string_across_tokens_ends_the_text_before_it(tokenizer):
    ids = tokenizer("The answer is 42. Next question: why?")["input_ids"]
    pieces, text = stream_pieces(tokenizer, ids, stop=["question", "zzz"])
    assert text.stopped and "".join(pieces) == text.text == "The answer is 42. Next "
    # Held back while it could still begin a stop string, released when it cannot.
    held, _ = stream_pieces(tokenizer, tokenizer("a quest for quests")["input_ids"],
                            stop=["question"])
    assert "".join(held) == "a quest for quests" and not _.stopped
    assert text.add(tokenizer(" more")["input_ids"]) == ""  # nothing after a stop


def test_special_tokens_are_skipped(tokenizer):
    eos = tokenizer.eos_token_id
    pieces, _ = stream_pieces(tokenizer, tokenizer("Hello")["input_ids"] + [eos])
    assert "".join(pieces) == "Hello"
