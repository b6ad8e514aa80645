"""Saves or restores the campaign's regenerated answers (issue 18), without any prompt text.

    python launch/smollm2_campaign/answers.py export   # data/campaign/* -> launch/smollm2_campaign/answers/*.npz
    python launch/smollm2_campaign/answers.py import   # the reverse, on a new machine (needs ../shared/data)

The answers are SmolLM2-135M-Instruct's own outputs; the prompts come from the shared training
prompt sets, which are never copied into the repository, so a folder is stored as its answers
and prompt indices (``training.data.export_answers``) and rebuilt byte for byte from them and
the prompt files (``import_answers``). After an import, ``bash launch/regenerate_smollm2.sh``
continues every folder where it stopped.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ANSWERS = Path(__file__).resolve().parent / "answers"
# Folder -> its prompt file (the selection and first prompt are in each folder's manifest).
PROMPT_FILES = {"math": "math_prompts.jsonl", "heldout_math": "math_prompts.jsonl",
                "code": "sharegpt_prompts.jsonl", "heldout_code": "sharegpt_prompts.jsonl",
                "chat": "sharegpt_prompts.jsonl", "heldout_chat": "sharegpt_prompts.jsonl"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("direction", choices=("export", "import"))
    parser.add_argument("--data", default=str(ROOT / "data" / "campaign"))
    parser.add_argument("--shared", default=str(ROOT.parent / "shared" / "data" / "train"))
    args = parser.parse_args(argv)
    from dspark_jax.training import data

    if args.direction == "export":
        ANSWERS.mkdir(exist_ok=True)
        import json

        import numpy as np

        for name in PROMPT_FILES:
            folder, file = Path(args.data) / name, ANSWERS / f"{name}.npz"
            if (folder / "manifest.json").exists():
                if file.exists():  # unchanged folders keep their file (no churn in git)
                    with np.load(file) as f:
                        if json.loads(str(f["manifest"])) == data.load_manifest(folder):
                            continue
                manifest = data.export_answers(folder, file)
                print(f"{name}: {manifest['num_samples']} samples, {manifest['num_loss_tokens']} answer tokens")
        return 0
    import dspark_jax

    target = dspark_jax.load_target("smollm2-135m-instruct")
    for name, prompts in PROMPT_FILES.items():
        if (ANSWERS / f"{name}.npz").exists():
            manifest = data.import_answers(target, ANSWERS / f"{name}.npz",
                                           [Path(args.shared) / prompts], Path(args.data) / name)
            print(f"{name}: {manifest['num_samples']} samples rebuilt under {Path(args.data) / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
