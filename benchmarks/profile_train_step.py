"""Where a train step's time goes: XLA:CPU's own per-operation profile of the cached-feature step.

Builds the config's jitted train step (``bench_train_features.make_step``) on a synthetic batch
of the pipeline's shapes with cached features (``synthetic_batch``: ``global_batch_size`` rows
of ``pack_length`` tokens, ``anchors_per_row`` anchors), runs it once to compile, then
``--steps`` times under ``jax.profiler`` with XLA:CPU's trace annotations, and prints the
operations of the compiled step by total time per step, each with its output shape:

    python benchmarks/profile_train_step.py --config configs/dspark_smollm2_135m.py --group

The trace and the HLO stay under ``--workdir``. A diagnostic for reading the HLO, not a
benchmark (the annotations cost a little): step times for BENCHMARKS.md come from
bench_train_features.py.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from _common import ROOT, op_table

# XLA:CPU emits per-thunk trace events only with this flag, read when the backend starts.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "dspark_smollm2_135m.py")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--feature-dtype", default="bfloat16")
    parser.add_argument("--pack-length", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=0)
    parser.add_argument("--compute-dtype", choices=("float32", "bfloat16"),
                        help="the step's forward dtype (default: the config's train.compute_dtype)")
    parser.add_argument("--group", action="store_true", help="sum ops that differ by suffix")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/dspark_profile_train"))
    args = parser.parse_args()

    import jax

    from bench_train_features import make_step, setup, synthetic_batch

    from dspark_jax.training.trainer import compute_dtype

    _, target, drafter, tcfg = setup(args)
    step, fresh_state = make_step(target, drafter, tcfg)
    batch = synthetic_batch(target, drafter, tcfg.global_batch_size, tcfg.pack_length,
                            tcfg.anchors_per_row, args.feature_dtype)
    state = fresh_state()
    compiled = step.lower(state, target.state, batch).compile()
    state, _ = jax.block_until_ready(compiled(state, target.state, batch))

    trace_dir = args.workdir / "trace"
    started = time.perf_counter()
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        for _ in range(args.steps):
            state, _ = jax.block_until_ready(compiled(state, target.state, batch))
    seconds = (time.perf_counter() - started) / args.steps
    hlo = compiled.as_text()
    args.workdir.mkdir(parents=True, exist_ok=True)
    (args.workdir / "train_step.hlo").write_text(hlo)
    print(f"{tcfg.global_batch_size} rows x {tcfg.pack_length} tokens, {tcfg.anchors_per_row} "
          f"anchors per row, cached {args.feature_dtype} features, compute "
          f"{compute_dtype(tcfg).name}: {seconds:.2f} s per step "
          "(traced); ms per step:")
    print("\n".join(op_table(trace_dir, hlo, args.steps, group=args.group, top=args.top)))
    print(f"trace: {trace_dir}\nHLO: {args.workdir / 'train_step.hlo'}")


if __name__ == "__main__":
    main()
