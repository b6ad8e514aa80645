"""How far the target's next-token law moves with bfloat16 weight matrices (issue 19's tolerance).

``Engine(weight_dtype="bfloat16")`` multiplies every matmul in bfloat16 and accumulates in
float32 (``layer_weights.with_dtype``). This script measures what that does to SmolLM2's
output, teacher-forced over the answers of regenerated training data (or any data folder):
at every answer position the float32 target's logits against the bfloat16-weight target's,

* the largest absolute logit difference, and its median per position;
* how often the greedy (argmax) token is the same;
* the total variation distance between the two next-token laws at temperature 1, mean and
  99th percentile (speculative sampling accepts a draft from one law under the other with
  probability 1 - TV: the cost of drafting with one and verifying with the other);
* KL(float32 || bfloat16), mean.

    python benchmarks/weight_dtype_tolerance.py --data data/campaign/heldout_math \
        data/campaign/heldout_code data/campaign/heldout_chat --samples 24 \
        --output benchmarks/results/weight_dtype_tolerance.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from _common import ROOT, command_line, cpu_name


def first_samples(folder: Path, count: int):
    """The first ``count`` samples of a data folder: (input_ids [S], loss_mask [S])."""
    from dspark_jax.training import data

    for entry in data.load_manifest(folder)["files"]:
        shard = data.read_shard(folder / entry["file"])
        offsets = shard["offsets"]
        for start, end in zip(offsets[:-1], offsets[1:]):
            if count == 0:
                return
            count -= 1
            yield shard["tokens"][start:end], shard["loss_mask"][start:end]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--data", nargs="+", required=True, type=Path,
                        help="training data folders (prepare-data): their answers are scored")
    parser.add_argument("--samples", type=int, default=24, help="samples per folder")
    parser.add_argument("--output", type=Path,
                        default=ROOT / "benchmarks" / "results" / "weight_dtype_tolerance.json")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import dspark_jax

    target = dspark_jax.load_target(args.model)
    states = {"float32": target.state, "bfloat16": target.inference_state("stacked", jnp.bfloat16)}

    @jax.jit
    def log_probs(state, ids):
        model = nnx.merge(target.graphdef, state)
        positions = jnp.arange(ids.shape[1])[None]
        return jax.nn.log_softmax(model.logits(model(ids, positions).hidden), axis=-1)

    per_position = {k: [] for k in ("max_abs", "same_argmax", "tv", "kl")}
    max_abs = 0.0
    for folder in args.data:
        for ids, loss_mask in first_samples(folder, args.samples):
            ids = jnp.asarray(ids[None], jnp.int32)
            want, got = (np.asarray(log_probs(states[k], ids)[0], np.float64) for k in states)
            # Position t predicts token t + 1: score the positions before answer tokens.
            where = np.flatnonzero(loss_mask[1:])
            want, got = want[where], got[where]
            diff = np.abs((got - got.mean(-1, keepdims=True)) - (want - want.mean(-1, keepdims=True)))
            per_position["max_abs"] += diff.max(-1).tolist()
            max_abs = max(max_abs, float(diff.max()))
            per_position["same_argmax"] += (got.argmax(-1) == want.argmax(-1)).tolist()
            p, q = np.exp(want), np.exp(got)
            per_position["tv"] += (0.5 * np.abs(p - q).sum(-1)).tolist()
            per_position["kl"] += (p * (want - got)).sum(-1).tolist()
    positions = len(per_position["tv"])
    tv = np.asarray(per_position["tv"])
    result = dict(
        benchmark="weight_dtype_tolerance", model=args.model, data=[str(d) for d in args.data],
        samples_per_folder=args.samples, positions=positions,
        max_abs_logit_difference=max_abs,
        median_max_abs_logit_difference=float(np.median(per_position["max_abs"])),
        same_argmax=float(np.mean(per_position["same_argmax"])),
        tv_mean=float(tv.mean()), tv_p99=float(np.percentile(tv, 99)),
        kl_mean=float(np.mean(per_position["kl"])),
        machine=cpu_name(), cpus=os.cpu_count(), load_average=list(os.getloadavg()),
        jax=jax.__version__, date=time.strftime("%Y-%m-%d %H:%M:%S"), command=command_line(__file__))
    print(json.dumps({k: v for k, v in result.items() if k not in ("data",)}, indent=2))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
