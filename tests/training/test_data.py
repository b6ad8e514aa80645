"""prepare_data: prompt reading, sample building, filters, manifest, resume after a kill."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import dspark_jax
from dspark_jax.generation import GenerationResult
from dspark_jax.prompts import chat_ids
from dspark_jax.training import data

MATH_PROMPTS = Path(__file__).resolve().parents[3] / "shared/data/train/math_prompts.jsonl"
SETTINGS = dict(max_samples=6, batch_size=3, shard_size=3, max_new_tokens=24, max_length=512,
                min_loss_tokens=1, seed=5, progress=False)


def read_all(out_dir) -> dict[str, np.ndarray]:
    """All shards of a folder, concatenated (offsets made global)."""
    manifest = data.load_manifest(out_dir)
    shards = [data.read_shard(Path(out_dir) / f["file"]) for f in manifest["files"]]
    base = np.cumsum([0] + [len(s["tokens"]) for s in shards])[:-1]
    return dict(tokens=np.concatenate([s["tokens"] for s in shards]),
                loss_mask=np.concatenate([s["loss_mask"] for s in shards]),
                prompt_index=np.concatenate([s["prompt_index"] for s in shards]),
                offsets=np.concatenate([[0]] + [s["offsets"][1:] + b
                                                for s, b in zip(shards, base)]))


def samples(out_dir) -> list[tuple[int, np.ndarray, np.ndarray]]:
    arrays = read_all(out_dir)
    o = arrays["offsets"]
    return [(int(p), arrays["tokens"][o[i]:o[i + 1]], arrays["loss_mask"][o[i]:o[i + 1]])
            for i, p in enumerate(arrays["prompt_index"])]


@pytest.fixture(scope="module")
def math_files():
    if not MATH_PROMPTS.exists():
        pytest.skip(f"{MATH_PROMPTS} not found")
    return [MATH_PROMPTS]


@pytest.fixture(scope="module")
def uninterrupted(smollm2, math_files, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    manifest = data.prepare_data(smollm2, math_files, out, **SETTINGS)
    return out, manifest


def test_read_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"turns": ["a", "b"]}\n\n{"prompt": "c"}\n')
    assert data.read_prompts([path, path]) == ["a", "c", "a", "c"]
    path.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="p.jsonl:1"):
        data.read_prompts([path])
    path.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match="p.jsonl:2: not a JSON object"):
        data.read_prompts([path])
    path.write_text('{"prompt": "a"}\n["b"]\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: not a JSON object \(got list\)"):
        data.read_prompts([path])


def test_build_sample_masks_answer_and_filters():
    ids, mask = data.build_sample([5, 6, 7], [8, 9, 2], max_length=10, min_loss_tokens=3)
    assert ids.tolist() == [5, 6, 7, 8, 9, 2] and mask.tolist() == [0, 0, 0, 1, 1, 1]
    ids, mask = data.build_sample([5, 6, 7], [8, 9, 2], max_length=5, min_loss_tokens=2)
    assert ids.tolist() == [5, 6, 7, 8, 9] and mask.tolist() == [0, 0, 0, 1, 1]
    assert data.build_sample([5, 6, 7], [8, 9, 2], max_length=5, min_loss_tokens=3) is None


def test_filters_and_manifest_counts(smollm2, tmp_path, monkeypatch):
    prompts = ["short answer", "", "long answer", "x " * 200, "exact answer"]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    answer_len = {"short answer": 3, "long answer": 20, "exact answer": 14}

    def fake_generate(target, prompt_ids, **kwargs):
        texts = [smollm2.tokenizer.decode(ids) for ids in prompt_ids]
        lens = [next(n for p, n in answer_len.items() if p in t) for t in texts]
        return [GenerationResult(list(range(10, 10 + n)), "", {}) for n in lens]

    monkeypatch.setattr(data, "generate", fake_generate)
    manifest = data.prepare_data(smollm2, [path], tmp_path / "out", batch_size=2, shard_size=2,
                                 max_length=160, progress=False)
    assert manifest["dropped"] == dict(empty_prompt=1, long_prompt=1, few_loss_tokens=1)
    assert [f["prompts"] for f in manifest["files"]] == [[0, 2], [2, 4], [4, 5]]
    assert [f["samples"] for f in manifest["files"]] == [0, 1, 1]
    got = samples(tmp_path / "out")
    assert [p for p, _, _ in got] == [2, 4]
    assert [int(m.sum()) for _, _, m in got] == [20, 14]
    assert manifest["num_samples"] == 2 and manifest["num_loss_tokens"] == 34
    assert manifest["num_tokens"] == sum(len(ids) for _, ids, _ in got)
    assert manifest == data.load_manifest(tmp_path / "out")
    assert manifest["sources"] == [dict(path=str(path.resolve()), records=5)]


def test_loss_mask_covers_exactly_the_generated_tokens(smollm2, uninterrupted, math_files):
    out, manifest = uninterrupted
    assert manifest["prompts_done"] == 6 and len(manifest["files"]) == 2
    assert manifest["num_samples"] == 6 and sum(manifest["dropped"].values()) == 0
    prompts = data.read_prompts(math_files)[:3]
    prompt_ids = [chat_ids(smollm2.tokenizer, p) for p in prompts]
    direct = dspark_jax.generate(smollm2, prompt_ids, max_new_tokens=24, temperature=0.7,
                                 top_p=0.8, top_k=20,
                                 seeds=[data.prompt_seed(5, i) for i in range(3)])
    for (index, ids, mask), p_ids, result in zip(samples(out), prompt_ids, direct):
        assert ids[:len(p_ids)].tolist() == p_ids
        assert ids[len(p_ids):].tolist() == result.token_ids
        assert mask.tolist() == [0] * len(p_ids) + [1] * len(result.token_ids)


def test_resume_after_kill_equals_uninterrupted(smollm2, uninterrupted, math_files, tmp_path,
                                                monkeypatch):
    out = tmp_path / "killed"

    def dying_generate(*args, on_finished, **kwargs):
        """Killed when the fifth prompt finishes: the first shard (prompts 0-2) is written."""
        finished = []

        def counting(index, tokens):
            finished.append(index)
            if len(finished) == 5:
                raise KeyboardInterrupt("killed")
            on_finished(index, tokens)
        return dspark_jax.generate(*args, on_finished=counting, **kwargs)

    monkeypatch.setattr(data, "generate", dying_generate)
    with pytest.raises(KeyboardInterrupt):
        data.prepare_data(smollm2, math_files, out, **SETTINGS)
    partial = data.load_manifest(out)
    assert partial["prompts_done"] == 3 and len(partial["files"]) == 1

    with pytest.raises(ValueError, match="other prompt files or settings"):
        data.prepare_data(smollm2, math_files, out, **{**SETTINGS, "seed": 6})
    with pytest.raises(ValueError, match="other prompt files or settings"):  # another law
        data.prepare_data(smollm2, math_files, out, **SETTINGS, weight_dtype="bfloat16")
    monkeypatch.setattr(data, "generate", dspark_jax.generate)
    resumed = data.prepare_data(smollm2, math_files, out, **SETTINGS)

    reference_dir, reference = uninterrupted
    assert resumed == reference
    # Rows per batch and prompts per shard group the work only: another grouping resumes.
    sources = [dict(path=str(Path(f).resolve()), records=len(data.read_prompts([f])))
               for f in math_files]
    regrouped = data._resume_manifest(out, sources, dict(resumed["settings"], batch_size=1,
                                                          shard_size=5))
    assert regrouped["prompts_done"] == 6
    assert (regrouped["settings"]["batch_size"], regrouped["settings"]["shard_size"]) == (1, 5)
    for key, value in read_all(reference_dir).items():
        np.testing.assert_array_equal(read_all(out)[key], value, err_msg=key)
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "shard_00000.npz",
                                                      "shard_00001.npz"]

    def no_generate(*args, **kwargs):
        raise AssertionError("a finished run must not generate again")

    monkeypatch.setattr(data, "generate", no_generate)
    assert data.prepare_data(smollm2, math_files, out, **SETTINGS) == reference


def test_a_weight_dtype_reaches_the_engine_and_the_folders_settings(smollm2, tmp_path,
                                                                     monkeypatch):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(4)))
    seen = []

    def fake_generate(target, prompt_ids, **kwargs):
        seen.append(kwargs["weight_dtype"])
        return [GenerationResult(list(range(10, 30)), "", {}) for _ in prompt_ids]

    monkeypatch.setattr(data, "generate", fake_generate)
    manifest = data.prepare_data(smollm2, [path], tmp_path / "out", batch_size=2, shard_size=2,
                                 weight_dtype="bfloat16", progress=False)
    assert seen == ["bfloat16"] and manifest["num_samples"] == 4  # one engine run for both shards
    assert manifest["settings"]["weight_dtype"] == "bfloat16"
    plain = data.prepare_data(smollm2, [path], tmp_path / "plain", batch_size=2, shard_size=2,
                              progress=False)
    assert seen[-1] is None and "weight_dtype" not in plain["settings"]


def test_select_keeps_code_or_chat_prompts(smollm2, tmp_path, monkeypatch):
    prompts = ["Write a Python function that sorts a list", "Plan a trip to Rome",
               "Fix this:\n```\nx = 1\n```", "How do I debug a segfault?", "Tell me a joke"]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    asked = []

    def fake_generate(target, prompt_ids, **kwargs):
        asked.extend(smollm2.tokenizer.decode(ids) for ids in prompt_ids)
        return [GenerationResult(list(range(10, 30)), "", {}) for _ in prompt_ids]

    monkeypatch.setattr(data, "generate", fake_generate)
    code = data.prepare_data(smollm2, [path], tmp_path / "code", select="code", batch_size=4,
                             max_length=160, progress=False)
    assert [p for p in prompts if any(p in a for a in asked)] == [prompts[0], prompts[2], prompts[3]]
    assert code["settings"]["select"] == "code" and code["num_samples"] == 3
    asked.clear()
    chat = data.prepare_data(smollm2, [path], tmp_path / "chat", select="chat", batch_size=4,
                             first_prompt=1, max_length=160, progress=False)
    assert [p for p in prompts if any(p in a for a in asked)] == [prompts[4]]
    assert chat["num_samples"] == 1
    with pytest.raises(ValueError, match="unknown prompt selection 'math'"):
        data.prepare_data(smollm2, [path], tmp_path / "x", select="math", progress=False)


def test_answers_export_rebuilds_the_folder_without_the_prompts(smollm2, tmp_path, monkeypatch):
    """export_answers keeps only the generated tokens; import_answers rebuilds every shard and
    the manifest from them and the prompt files (which must not be copied anywhere)."""
    prompts = [f"Question number {i}: what is {i} + {i}?" for i in range(7)] + ["Write Python code"]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))

    def fake_generate(target, prompt_ids, **kwargs):
        return [GenerationResult(list(range(100 + len(ids), 100 + len(ids) + 30)), "", {})
                for ids in prompt_ids]

    monkeypatch.setattr(data, "generate", fake_generate)
    made = data.prepare_data(smollm2, [path], tmp_path / "made", select="chat", first_prompt=1,
                             batch_size=2, shard_size=4, max_length=64, progress=False)
    assert made["num_samples"] == 6 and len(made["files"]) == 2  # answers truncated to 64 - 43
    exported = tmp_path / "answers.npz"
    data.export_answers(tmp_path / "made", exported)
    with np.load(exported) as f:
        assert len(f["answers"]) == made["num_loss_tokens"]  # answers only, no prompt tokens
    rebuilt = data.import_answers(smollm2, exported, [path], tmp_path / "rebuilt")
    assert rebuilt == made
    for entry in made["files"]:
        a, b = (data.read_shard(tmp_path / d / entry["file"]) for d in ("made", "rebuilt"))
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"prompt": p + "!"}) + "\n" for p in prompts))
    with pytest.raises(ValueError, match="does not rebuild|other tokens"):
        data.import_answers(smollm2, exported, [other], tmp_path / "bad")
