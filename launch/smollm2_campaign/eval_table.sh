#!/usr/bin/env bash
# The eval table of issue 18 with the packaged pair: DSpark and DFlash on the nine benchmark
# sets at T = 1 and T = 0 (full block, 96 new tokens, batches of at most 10, at most 16,384
# padded prompt tokens per batch), then the figures and the report of each temperature:
#
#   bash launch/smollm2_campaign/eval_table.sh [LIMIT] [OUTPUT]   # defaults: 20, benchmarks/results
#
# writes OUTPUT/eval_table_t1, OUTPUT/eval_table_t0 and OUTPUT/figures_table. Every (drafter,
# set) cell is saved when it finishes and reused by the next call with the same settings and
# models, so rerunning after an interruption continues where it stopped. T = 1 runs first: the
# figures and the STS calibration read its traces.
set -euo pipefail
cd "$(dirname "$0")/../.."
LIMIT=${1:-20}
OUT=${2:-benchmarks/results}
SETS=gsm8k,math500,aime25,humaneval,mbpp,livecodebench,mt-bench,alpaca,arena-hard-v2
for T in 1 0; do
  for SET in ${SETS//,/ }; do
    # One process per set: XLA:CPU maps every compiled kernel into memory, and one process
    # compiling the programs of all nine sets' prompt shapes reached Linux's 65,530 mappings.
    dspark-jax eval --drafter dspark-smollm2-135m --drafter dflash-smollm2-135m \
      --label dspark --label dflash --bench "$SET" --limit "$LIMIT" --temperature "$T" \
      --max-new-tokens 96 --batch-size 10 --max-batch-tokens 16384 --output "$OUT/eval_table_t$T"
  done
  dspark-jax eval --drafter dspark-smollm2-135m --drafter dflash-smollm2-135m \
    --label dspark --label dflash --bench "$SETS" --output "$OUT/eval_table_t$T" --report-only
  if [ "$T" = 1 ]; then
    python benchmarks/make_figures.py --eval "$OUT/eval_table_t1" --dspark dspark \
      --output "$OUT/figures_table"
  fi
done
