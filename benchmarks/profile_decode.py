"""Where a decode step's time goes: XLA:CPU's own per-operation profile of ``generate``.

Runs ``dspark_jax.generate`` (greedy or sampled) once to compile, then once under
``jax.profiler`` with XLA:CPU's trace annotations, and prints the operations of the compiled
program by total time per decode step, each with its output shape from the compiled HLO:

    python benchmarks/profile_decode.py --batch 1 --max-new-tokens 64
    python benchmarks/profile_decode.py --batch 32 --temperature 0.7 --top-p 0.8 --top-k 20
    python benchmarks/profile_decode.py --drafter dspark-smollm2-135m   # per speculative round
    python benchmarks/profile_decode.py --drafter dspark-smollm2-135m-campaign --draft-weight-dtype bfloat16
    python benchmarks/profile_decode.py --batch 8 --weight-dtype bfloat16 --layer-weights unstacked

With ``--drafter`` the run decodes speculatively (the whole block verified) and the table is per
round: the draft step's operations (the drafter's layers, its LM head, the block sampler's scan)
beside the verify's.

Each operation is named with its program: ``admit`` (the prefill, whose operations are spread
over the decode steps: use many ``--max-new-tokens`` to dilute it) or ``run_rounds`` (the
decode loop). ``--group`` adds up a program's operations that differ only in their numeric
suffix (copies of one fusion; the shape shown is then that of one of them). The trace and the
HLO are kept under ``--workdir``.
This is a diagnostic for reading the HLO, not a benchmark: the trace annotations themselves
cost a little, so time figures for BENCHMARKS.md come from bench_ar_generate.py.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from _common import op_table

# XLA:CPU emits per-thunk trace events only with this flag, read when the backend starts.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()

ROOT = Path(__file__).resolve().parents[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=200, help="tokens per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--drafter", help="drafter folder or packaged name: profile speculative "
                        "rounds (verify the whole block) instead of autoregressive steps")
    parser.add_argument("--weight-dtype", choices=["bfloat16"],
                        help="the target's weight matrices in this dtype (Engine(weight_dtype=))")
    parser.add_argument("--draft-weight-dtype", choices=["bfloat16"],
                        help="the drafter's weight matrices in this dtype (the demo's default)")
    parser.add_argument("--layer-weights", choices=["stacked", "unstacked"],
                        help="layout of the target's layer weights (default: the engine's)")
    parser.add_argument("--group", action="store_true", help="sum ops that differ by suffix")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/dspark_profile"))
    args = parser.parse_args()

    import jax

    import dspark_jax
    from dspark_jax import engine

    target = dspark_jax.load_target(args.model)
    prompts = [[(17 + 31 * row + i) % 1000 + 10 for i in range(args.prompt_len)]
               for row in range(args.batch)]
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
              top_p=args.top_p, top_k=args.top_k, weight_dtype=args.weight_dtype,
              layer_weights=args.layer_weights)
    if args.drafter:
        kw.update(drafter=dspark_jax.load_drafter(args.drafter, target), verify="full",
                  draft_weight_dtype=args.draft_weight_dtype)
    dspark_jax.generate(target, prompts, **kw)  # compile

    trace_dir = args.workdir / "trace"
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        results = dspark_jax.generate(target, prompts, **kw)
    steps = max(1, results[0].stats["steps"])

    # The compiled HLO of the engine's programs (the admission and the rounds: the only ones
    # compiled here), for output shapes.
    hlo = "\n".join(program.as_text() for program in engine.compiled_programs())
    (args.workdir / "decode.hlo").write_text(hlo)
    unit = "speculative rounds" if args.drafter else "decode steps"
    print(f"batch {args.batch}, prompt {args.prompt_len}, {steps} {unit}; ms per step, by "
          "program (admit: the prefill, spread over the steps; run_rounds: the decode loop):")
    print("\n".join(op_table(trace_dir, hlo, steps, group=args.group, top=args.top)))
    print(f"trace: {trace_dir}\nHLO: {args.workdir / 'decode.hlo'}")


if __name__ == "__main__":
    main()
