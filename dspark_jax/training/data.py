"""Training data preparation: prompts in, target-regenerated conversations out (spec section 6).

Each prompt (first turn of a ``{"turns": [...]}`` JSONL record, or ``{"prompt": ...}``) gets the
target's chat template with the generation prompt; the target itself samples the answer
(T 0.7, top-p 0.8, top-k 20 by default). A sample is the conversation's token ids with
loss_mask = 1 on the generated answer tokens (EOS included), truncated to ``max_length``;
samples with fewer than ``min_loss_tokens`` loss tokens are dropped.

Output folder (read by ``dspark_jax.training.pipeline``):

  shard_00000.npz ...  one per ``shard_size`` prompts, uncompressed, arrays
      tokens       int32 [T]      all samples' token ids, concatenated
      loss_mask    uint8 [T]      1 on assistant (generated) tokens
      offsets      int64 [n + 1]  sample i is tokens[offsets[i]:offsets[i + 1]]
      prompt_index int64 [n]      global index of the prompt each sample came from
  manifest.json   files (name, samples, tokens, loss_tokens, prompt range), totals, dropped
                  counts, source files, settings, prompts_done (prompts [0, prompts_done) are
                  covered by the listed shards).

Runs are resumable: every shard is written to a temporary file and renamed, then the manifest
is rewritten the same way, so a killed run restarts after the last complete shard. One
engine run answers all the prompts (continuous batching across shards: no shard waits for its
last rows while the others idle) and a shard is written as soon as its prompts are answered.
Each prompt samples from its own seed (the base seed and its index), and the engine's kernels
give a row the same bits whatever decodes beside it, so a resumed run writes the same data as
an uninterrupted one.
"""

from __future__ import annotations

import io
import json
import os
import re
import time
import zlib
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from tqdm.auto import tqdm

from dspark_jax import storage
from dspark_jax.generation import generate
from dspark_jax.jsonl import read_jsonl
from dspark_jax.prompts import chat_ids
from dspark_jax.target import Target

MANIFEST = "manifest.json"
FORMAT = "dspark-jax-tokens-v1"

# A prompt "asks for code" when it names a language, a code artefact or holds a code fence.
_CODE_PROMPT = re.compile(
    r"```|\b(code|coding|programming|python|javascript|typescript|java|c\+\+|c#|golang|rust|sql|"
    r"html|css|react|node\.?js|bash|shell script|regex|function|script|algorithm|api|json|"
    r"compile|debug|implement|django|flask|pandas|numpy|kotlin|swift|php|ruby|scala|matlab|"
    r"dockerfile|kubernetes|yaml)\b", re.IGNORECASE)

# Named prompt subsets for ``prepare_data(select=...)``: the campaign's code and chat domains
# both come from ShareGPT prompts.
PROMPT_SELECTIONS: dict[str, Callable[[str], bool]] = {
    "code": lambda text: bool(_CODE_PROMPT.search(text)),
    "chat": lambda text: not _CODE_PROMPT.search(text),
}


def read_prompts(files: Sequence[str | os.PathLike]) -> list[str]:
    """The prompts of JSONL files, in file then line order (blank lines skipped).

    A record is ``{"turns": [first, ...]}`` (the first turn is used) or ``{"prompt": text}``.
    """
    return [_prompt_text(record, where) for file in files for where, record in read_jsonl(file)]


def _prompt_text(record: dict, where: str) -> str:
    if isinstance(record.get("turns"), list) and record["turns"]:
        return str(record["turns"][0])
    if "prompt" in record:
        return str(record["prompt"])
    raise ValueError(f"{where}: expected a 'turns' list or a 'prompt' field")


def selected_prompts(prompts: list[str], select: str | None, first_prompt: int, *,
                     where: str) -> list[str]:
    """The prompts ``prepare_data`` indexes samples by: the ``select`` subset
    (``PROMPT_SELECTIONS``; None keeps all), from ``first_prompt`` on.

    Raises:
      ValueError: unknown selection, or ``first_prompt`` outside the selected prompts of ``where``.
    """
    if select is not None:
        if select not in PROMPT_SELECTIONS:
            raise ValueError(f"unknown prompt selection {select!r}; known: "
                             f"{', '.join(sorted(PROMPT_SELECTIONS))}")
        prompts = [p for p in prompts if PROMPT_SELECTIONS[select](p)]
    if not 0 <= first_prompt < len(prompts):
        raise ValueError(f"first_prompt {first_prompt} is outside the {len(prompts)} prompts of {where}")
    return prompts[first_prompt:]


def build_sample(prompt_ids: Sequence[int], answer_ids: Sequence[int], *, max_length: int,
                 min_loss_tokens: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(input_ids int32 [S], loss_mask uint8 [S]) of one conversation, or None when dropped.

    loss_mask is 1 on the answer tokens; S = min(len(prompt) + len(answer), max_length). The
    sample is dropped when fewer than ``min_loss_tokens`` answer tokens survive truncation.
    """
    ids = np.asarray(list(prompt_ids) + list(answer_ids), np.int32)[:max_length]
    mask = np.zeros(len(ids), np.uint8)
    mask[len(prompt_ids):] = 1
    if int(mask.sum()) < min_loss_tokens:
        return None
    return ids, mask


def prompt_seed(seed: int, index: int) -> int:
    """The sampling seed of prompt ``index``: its request's own stream (``Engine.submit``), so its
    answer does not depend on the prompts decoding beside it, the rows or the shards."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


def _atomic_write(path: storage.PathLike, write: Callable) -> None:
    """Writes ``path`` (local or remote) whole through ``write(binary file)``."""
    buffer = io.BytesIO()
    write(buffer)
    storage.write_atomic(path, buffer.getvalue())


def shard_arrays(samples: Sequence[tuple[int, np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """The arrays of a shard (format above) of (prompt_index, input_ids [S], loss_mask [S]) samples."""
    lengths = [len(ids) for _, ids, _ in samples]
    return dict(
        tokens=np.concatenate([ids for _, ids, _ in samples] or [[]]).astype(np.int32),
        loss_mask=np.concatenate([m for _, _, m in samples] or [[]]).astype(np.uint8),
        offsets=np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64),
        prompt_index=np.asarray([i for i, _, _ in samples], np.int64),
    )


def tokens_crc32(shard: dict[str, np.ndarray]) -> int:
    """Checksum of a data shard's token ids and sample offsets."""
    crc = zlib.crc32(np.ascontiguousarray(shard["tokens"], np.int32).tobytes())
    return zlib.crc32(np.ascontiguousarray(shard["offsets"], np.int64).tobytes(), crc)


def write_shard(path: storage.PathLike, samples: Sequence[tuple[int, np.ndarray, np.ndarray]]) -> None:
    """Writes (prompt_index, input_ids [S], loss_mask [S]) samples as one shard (format above)."""
    arrays = shard_arrays(samples)
    _atomic_write(path, lambda f: np.savez(f, **arrays))


def read_shard(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The arrays of one shard (tokens, loss_mask, offsets, prompt_index), loaded in memory."""
    with storage.as_path(path).open("rb") as f, np.load(f) as shard:
        return {name: shard[name] for name in shard.files}


def write_manifest(out_dir: str | os.PathLike, manifest: dict) -> None:
    """Atomically (re)writes ``out_dir/manifest.json``."""
    storage.write_atomic(storage.as_path(out_dir) / MANIFEST, json.dumps(manifest, indent=1))


def load_manifest(data_dir: str | os.PathLike) -> dict | None:
    """The manifest of a data folder, or None when there is none yet."""
    path = storage.as_path(data_dir) / MANIFEST
    if not path.exists():
        return None
    return json.loads(path.read_text())


def answer_token_counts(data_dirs: Sequence[str | os.PathLike]) -> np.ndarray:
    """int64 [V]: how often each token id is an answer (loss) token of the prepared folders
    ``data_dirs`` (V from their manifests, which must agree).

    Raises:
      ValueError: a folder without a manifest, or folders of different vocabularies.
    """
    manifests = {str(d): load_manifest(d) for d in data_dirs}
    for d, manifest in manifests.items():
        if manifest is None:
            raise ValueError(f"{d}: no {MANIFEST} (not a prepared data folder)")
    sizes = {d: int(m["settings"]["vocab_size"]) for d, m in manifests.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"data folders of different vocabularies: {sizes}")
    counts = np.zeros(next(iter(sizes.values())), np.int64)
    for d, manifest in manifests.items():
        for entry in manifest["files"]:
            shard = read_shard(storage.as_path(d) / entry["file"])
            counts += np.bincount(shard["tokens"][shard["loss_mask"] == 1], minlength=counts.size)
    return counts


def most_frequent(counts: np.ndarray, size: int) -> np.ndarray:
    """int32 [size]: the ``size`` most frequent token ids of ``counts`` [V] (ties: lower id
    first), in ascending order: a drafter's draft vocabulary.

    Raises:
      ValueError: ``size`` not in [1, V].
    """
    if not 1 <= size <= counts.size:
        raise ValueError(f"a draft vocabulary of {size} tokens out of a vocabulary of {counts.size}")
    order = np.lexsort((np.arange(counts.size), -counts))  # by count descending, then id
    return np.sort(order[:size]).astype(np.int32)


def _new_manifest(sources: list[dict], settings: dict) -> dict:
    return dict(format=FORMAT, sources=sources, settings=settings, prompts_done=0, files=[],
                num_samples=0, num_tokens=0, num_loss_tokens=0,
                dropped=dict(empty_prompt=0, long_prompt=0, few_loss_tokens=0))


# Settings that group the work (rows decoding together, prompts per shard) without changing
# what a sample is: a folder may be resumed with others (each shard records its prompt range).
GROUPING_SETTINGS = ("batch_size", "shard_size")


def _resume_manifest(out_dir: storage.Path, sources: list[dict], settings: dict) -> dict:
    """The existing manifest when its sources and settings (but for GROUPING_SETTINGS) match,
    with the grouping updated to ``settings``; a fresh one when absent."""
    manifest = load_manifest(out_dir)
    if manifest is None:
        return _new_manifest(sources, settings)
    old_paths = [s["path"] for s in manifest["sources"]]

    def identity(values):
        return {k: v for k, v in values.items() if k not in GROUPING_SETTINGS}

    if old_paths != [s["path"] for s in sources] or identity(manifest["settings"]) != identity(settings):
        raise ValueError(f"{out_dir} holds data of other prompt files or settings "
                         f"({manifest['settings']}, sources {old_paths}); use a new folder")
    manifest["settings"] = dict(manifest["settings"], **{k: settings[k] for k in GROUPING_SETTINGS})
    return manifest


def _regenerate(target: Target, prompts: Sequence[str], start: int, stops: Sequence[int],
                settings: dict, dropped: dict, batch_size: int, write: Callable,
                progress=None) -> None:
    """Answers the prompts start, start + 1, ... in one engine run (``batch_size`` rows decoding
    together, a finished row's slot refilled with the next prompt, across shard boundaries)
    and calls ``write(samples, shard_start, shard_stop)`` for each shard, in order, as soon as
    its prompts are all answered; counts drops. A shard's prompts are [previous stop, stop) for
    the ascending ``stops``. ``progress`` is called with the number of prompts done, as they
    finish."""
    max_length, min_loss = settings["max_length"], settings["min_loss_tokens"]
    todo, skipped = [], []
    for index, text in enumerate(prompts, start):
        if not text.strip():
            dropped["empty_prompt"] += 1
            skipped.append(index)
            continue
        ids = chat_ids(target.tokenizer, text)
        if len(ids) + min_loss > max_length:
            dropped["long_prompt"] += 1
            skipped.append(index)
            continue
        todo.append((index, ids))
    if progress is not None and skipped:
        progress(len(skipped))
    answers = dict.fromkeys(skipped)  # prompt index -> answer token ids (None: dropped)
    bounds = list(zip([start, *stops[:-1]], stops))

    def write_ready():
        while bounds and all(i in answers for i in range(*bounds[0])):
            lo, hi = bounds.pop(0)
            samples = []
            for index in range(lo, hi):
                answer = answers.pop(index)
                if answer is None:
                    continue
                sample = build_sample(prompt_ids[index], answer, max_length=max_length,
                                      min_loss_tokens=min_loss)
                if sample is None:
                    dropped["few_loss_tokens"] += 1
                else:
                    samples.append((index, *sample))
            write(samples, lo, hi)

    prompt_ids = dict(todo)

    def finished(position, token_ids):
        answers[todo[position][0]] = token_ids
        write_ready()

    write_ready()  # shards with nothing to answer
    if todo:
        results = generate(target, [ids for _, ids in todo],
                           max_new_tokens=settings["max_new_tokens"],
                           temperature=settings["temperature"], top_p=settings["top_p"],
                           top_k=settings["top_k"],
                           seeds=[prompt_seed(settings["seed"], i) for i, _ in todo],
                           max_batch=batch_size, progress=progress, on_finished=finished,
                           weight_dtype=settings.get("weight_dtype"))
        for (index, _), result in zip(todo, results):  # any the callback did not see
            if bounds and index >= bounds[0][0] and index not in answers:
                answers[index] = result.token_ids
        write_ready()


def _add_shard(manifest: dict, name: str, samples: list, start: int, stop: int) -> None:
    tokens = sum(len(ids) for _, ids, _ in samples)
    loss_tokens = sum(int(m.sum()) for _, _, m in samples)
    manifest["files"].append(dict(file=name, samples=len(samples), tokens=tokens,
                                  loss_tokens=loss_tokens, prompts=[start, stop]))
    manifest["num_samples"] += len(samples)
    manifest["num_tokens"] += tokens
    manifest["num_loss_tokens"] += loss_tokens
    manifest["prompts_done"] = stop


def prepare_data(target: Target, prompt_files: Sequence[str | os.PathLike],
                 out_dir: str | os.PathLike, *, max_samples: int | None = None,
                 first_prompt: int = 0, batch_size: int = 8, max_new_tokens: int = 2048, max_length: int = 4096,
                 temperature: float = 0.7, top_p: float = 0.8, top_k: int = 20, seed: int = 0,
                 min_loss_tokens: int = 14, shard_size: int = 1024, select: str | None = None,
                 weight_dtype: str | None = None, progress: bool = True) -> dict:
    """Regenerates answers to prompts with the target and writes a training data folder.

    Args:
      target: the target model, with a tokenizer (its chat template formats the prompts).
      prompt_files: JSONL prompt files (never evaluation sets), read in order.
      out_dir: output folder, local or remote (created; an existing run there with the same
        files and settings is resumed after its last complete shard; ``batch_size`` and ``shard_size`` may differ).
      max_samples: use only the first ``max_samples`` prompts (None: all); kept samples are
        fewer when some are dropped. A later run with a larger value extends the data set.
      first_prompt: skip the prompts before this index (a held-out split: e.g. train on the
        first 192 prompts, evaluate on prompts from 2000 on).
      batch_size: rows decoding together (continuous batching over all the prompts: a row
        freed near a shard's end takes the next shard's prompt, and each shard is written as
        soon as its prompts are answered).
      max_new_tokens, temperature, top_p, top_k: sampling of the answers.
      max_length: conversations are truncated to this many tokens.
      seed: base seed; prompt i samples with its own ``prompt_seed(seed, i)`` (folders written
        before 2026-12-07 seeded each shard's batch instead: the same law).
      min_loss_tokens: samples with fewer answer tokens (after truncation) are dropped.
      shard_size: prompts per shard (the unit a killed run resumes from; rounded up to a
        multiple of ``batch_size``).
      select: keep only the prompts of a named subset (``PROMPT_SELECTIONS``: "code" = those
        that ask for code, "chat" = the others) before ``first_prompt`` / ``max_samples``
        count them; None keeps all.
      weight_dtype: decode with the target's weight matrices in this dtype ("bfloat16":
        ``Engine(weight_dtype=)``, 1.1-1.24x the tokens/s of float32 at 32-64 rows on a CPU
        with AMX; the answers are then the bfloat16-weight target's, as a GPU regenerates them);
        None: as loaded. Recorded in the settings.
      progress: show a tqdm bar (prompts, with samples/s).

    Returns:
      The manifest (also in ``out_dir/manifest.json``).
    """
    if target.tokenizer is None:
        raise ValueError("prepare_data needs a target with a tokenizer (chat template)")
    out = storage.as_path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [str(Path(f).resolve()) for f in prompt_files]
    per_file = [read_prompts([f]) for f in files]
    prompts = selected_prompts([p for file_prompts in per_file for p in file_prompts], select,
                               first_prompt, where=", ".join(files))
    sources = [dict(path=f, records=len(p)) for f, p in zip(files, per_file)]
    shard_size = -(-shard_size // batch_size) * batch_size
    settings = dict(target=target.name, vocab_size=int(target.config.vocab_size),
                    batch_size=batch_size, shard_size=shard_size, max_new_tokens=max_new_tokens,
                    max_length=max_length, temperature=temperature, top_p=top_p, top_k=top_k,
                    seed=seed, min_loss_tokens=min_loss_tokens)
    if first_prompt:
        settings["first_prompt"] = first_prompt
    if select is not None:
        settings["select"] = select
    if weight_dtype is not None:
        settings["weight_dtype"] = str(weight_dtype)
    manifest = _resume_manifest(out, sources, settings)
    manifest["max_samples"] = max_samples
    total = len(prompts) if max_samples is None else min(max_samples, len(prompts))
    bar = tqdm(total=total, initial=min(manifest["prompts_done"], total), unit="prompt",
               desc="prepare_data", disable=not progress, dynamic_ncols=True)
    made, started = 0, time.perf_counter()

    def write(samples, shard_start, shard_stop):
        nonlocal made
        made += len(samples)
        bar.set_postfix(samples=manifest["num_samples"] + len(samples),
                        samples_per_s=f"{made / (time.perf_counter() - started):.2f}")
        name = f"shard_{len(manifest['files']):05d}.npz"
        write_shard(out / name, samples)
        _add_shard(manifest, name, samples, shard_start, shard_stop)
        write_manifest(out, manifest)

    first = manifest["prompts_done"]
    if first < total:
        stops = list(range(first + shard_size, total, shard_size)) + [total]
        _regenerate(target, prompts[first:total], first, stops, settings, manifest["dropped"],
                    batch_size, write, bar.update)
    bar.close()
    write_manifest(out, manifest)
    return manifest


ANSWERS_FORMAT = "dspark-jax-answers-v1"


def export_answers(data_dir: str | os.PathLike, path: str | os.PathLike) -> dict:
    """Writes a data folder's generated answers without its prompts to one ``.npz`` file.

    The prompts come from shared prompt sets that must not be copied anywhere (the answers
    are the target's own outputs): the file holds, per sample, its prompt index and its answer
    tokens (as truncated), and the manifest; :func:`import_answers` rebuilds the folder, byte
    for byte, from it and the prompt files. Returns the manifest.
    """
    manifest = load_manifest(data_dir)
    if manifest is None:
        raise FileNotFoundError(f"no manifest.json in {data_dir}: not a prepare-data folder")
    answers, offsets, index, shard_of, checksums = [], [0], [], [], []
    for number, entry in enumerate(manifest["files"]):
        shard = read_shard(storage.as_path(data_dir) / entry["file"])
        checksums.append(tokens_crc32(shard))
        o = shard["offsets"]
        for i, prompt_index in enumerate(shard["prompt_index"]):
            mask = shard["loss_mask"][o[i]:o[i + 1]]
            answer = shard["tokens"][o[i]:o[i + 1]][int(np.argmax(mask > 0)):]
            answers.append(answer)
            offsets.append(offsets[-1] + len(answer))
            index.append(int(prompt_index))
            shard_of.append(number)
    arrays = dict(format=np.asarray(ANSWERS_FORMAT), manifest=np.asarray(json.dumps(manifest)),
                  answers=np.concatenate(answers or [np.zeros(0, np.int32)]).astype(np.int32),
                  offsets=np.asarray(offsets, np.int64), prompt_index=np.asarray(index, np.int64),
                  shard=np.asarray(shard_of, np.int64), tokens_crc32=np.asarray(checksums, np.int64))
    _atomic_write(path, lambda f: np.savez_compressed(f, **arrays))
    return manifest


def import_answers(target: Target, path: str | os.PathLike, prompt_files: Sequence[str | os.PathLike],
                   out_dir: str | os.PathLike) -> dict:
    """Rebuilds a prepare-data folder from :func:`export_answers`' file and the prompt files.

    Each sample is the chat template of its prompt (``target``'s tokenizer) followed by its
    answer, as ``prepare_data`` built it; shards and manifest are those of the exported folder,
    with the prompt files' paths of this machine, so ``prepare_data`` resumes the folder.

    Raises:
      ValueError: not an answers file, other prompt files (count or text), or a rebuilt sample
        that differs from the exported one (another tokenizer or chat template).
    """
    with storage.as_path(path).open("rb") as file, np.load(file) as f:
        if "format" not in f.files or str(f["format"]) != ANSWERS_FORMAT:
            raise ValueError(f"{path} is not a dspark-jax answers file")
        manifest = json.loads(str(f["manifest"]))
        answers, offsets = f["answers"], f["offsets"]
        index, shard_of, checksums = f["prompt_index"], f["shard"], f["tokens_crc32"]
    files = [str(Path(p).resolve()) for p in prompt_files]
    records = [len(read_prompts([p])) for p in files]
    if records != [s["records"] for s in manifest["sources"]]:
        raise ValueError(f"{path} was generated from prompt files with "
                         f"{[s['records'] for s in manifest['sources']]} records, "
                         f"{', '.join(files)} have {records}")
    settings = manifest["settings"]
    prompts = selected_prompts(read_prompts(files), settings.get("select"),
                               settings.get("first_prompt", 0), where=", ".join(files))
    out = storage.as_path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    per_shard = [[] for _ in manifest["files"]]
    for i, (prompt_index, number) in enumerate(zip(index, shard_of)):
        answer = answers[offsets[i]:offsets[i + 1]]
        sample = build_sample(chat_ids(target.tokenizer, prompts[int(prompt_index)]), answer,
                              max_length=settings["max_length"],
                              min_loss_tokens=settings["min_loss_tokens"])
        if sample is None or int(sample[1].sum()) != len(answer):
            raise ValueError(f"{path}: the sample of prompt {int(prompt_index)} does not rebuild "
                             f"(another tokenizer or chat template?)")
        per_shard[int(number)].append((int(prompt_index), *sample))
    for entry, samples, checksum in zip(manifest["files"], per_shard, checksums):
        if tokens_crc32(shard_arrays(samples)) != int(checksum):
            raise ValueError(f"{path}: shard {entry['file']} rebuilds with other tokens than "
                             f"exported (other prompts, tokenizer or chat template?)")
        write_shard(out / entry["file"], samples)
    manifest["sources"] = [dict(path=p, records=n) for p, n in zip(files, records)]
    write_manifest(out, manifest)
    return manifest
