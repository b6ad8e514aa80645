#!/usr/bin/env bash
# The campaign's DSpark training run (issue 18), resumable on this machine and continuable on a
# new one:
#
#   bash launch/smollm2_campaign/train.sh [STEPS] [WORKDIR]     # defaults: 500, runs/campaign
#   FEATURES=online bash launch/smollm2_campaign/train.sh ...    # no training feature cache
#   START=bigram|reference CONFIG=configs/... bash ...              # a fresh drafter (compare.sh)
#   LR=3e-4 bash launch/smollm2_campaign/train.sh ...             # peak learning rate (config's
#                                                                 # train.learning_rate if unset)
#   BATCH=16 HELDOUT_EVERY=100 CHECKPOINT_EVERY=100 bash ...      # rows of 512 tokens per step
#       (default the config's, 4), held-out curve and checkpoint intervals (defaults 50, 25)
#   ARGS="--train.attention=einsum" bash ...                      # any other config overrides
#   LAYERS=4 bash launch/smollm2_campaign/train.sh ...            # grow the warm start's draft
#       layers to 4 (train.grow_layers: the added ones start as identity blocks); unset: the
#       packaged drafter's own depth
#   DTYPE=bfloat16 bash launch/smollm2_campaign/train.sh ...      # the step's forward dtype
#       (train.compute_dtype; float32 on a CPU if unset): bfloat16 where the CPU has AMX
#       (`grep amx_bf16 /proc/cpuinfo`), 1.7x faster cached steps there, or AVX-512 BF16 (the
#       AMD EPYC kind: 1.36x; BENCHMARKS.md); the feature caches are extracted in float32 and
#       stored in bfloat16 either way
#
# 1. Freezes data/campaign (from `answers.py import` and `launch/regenerate_smollm2.sh`) into
#    WORKDIR/data once (hard links: the data job may keep writing to data/campaign).
# 2. Caches the target's features of the snapshot (`prepare-features`, resumable). With
#    FEATURES=online only the held-out folders are cached and each train step runs the target
#    (about 1.9x the step time, BENCHMARKS.md): on a fresh machine that trains for less than
#    the cache's own cost (about an hour for the whole set on a 2-core CPU) it gets further.
# 3. Trains CONFIG (default configs/dspark_smollm2_135m.py). START=warm (default) warm-starts
#    from the packaged drafter dspark_jax/assets/dspark-smollm2-135m-campaign when present,
#    else takes the bigram-SVD Markov start (BENCHMARKS.md, recipe ablation); START=bigram always starts fresh
#    from it, START=reference from the reference initialisation (a drafter without a Markov
#    head: DFlash). The held-out curve goes to WORKDIR/heldout.jsonl. A rerun with the same
#    WORKDIR resumes from its Orbax checkpoints.
# To stop early: kill it after a checkpoint (every 25 steps), then rerun with STEPS = that
# checkpoint's step: it resumes, runs no step and exports WORKDIR/drafter.
# Afterwards: `dspark-jax convert --drafter WORKDIR/drafter --to deepspec --dtype bfloat16
# --compact --output /tmp/drafter`, copy its config.json and model.safetensors into
# dspark_jax/assets/dspark-smollm2-135m-campaign (its draft_vocab.json stays) and commit them,
# so the next machine goes on from there.
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${1:-500}
WORK=${2:-runs/campaign}
CONFIG=${CONFIG:-configs/dspark_smollm2_135m.py}
START=${START:-warm}
PACKAGED=dspark_jax/assets/dspark-smollm2-135m-campaign
case $START in
  warm) if [ -f $PACKAGED/config.json ]; then
          # The packaged drafter's depth, or LAYERS in all (more: train.grow_layers, identity layers).
          HAS=$(python -c "import json; print(json.load(open('$PACKAGED/config.json'))['num_hidden_layers'])")
          LAYERS=${LAYERS:-$HAS}
          INIT=(--train.init_from=$PACKAGED --drafter.num_layers="$LAYERS")
          if [ "$LAYERS" -ne "$HAS" ]; then INIT+=(--train.grow_layers=True); fi
        else
          INIT=(--train.markov_init=bigram)
        fi ;;
  bigram) INIT=(--train.markov_init=bigram) ;;
  reference) INIT=(--train.markov_init=reference) ;;
  *) echo "START=$START: choose warm, bigram or reference" >&2; exit 2 ;;
esac
OVERRIDES=()
if [ -n "${LR:-}" ]; then
  OVERRIDES=(--train.learning_rate="$LR")  # e.g. lower for a warm start than for a fresh drafter
fi
if [ -n "${DTYPE:-}" ]; then
  OVERRIDES+=(--train.compute_dtype="$DTYPE")
fi
if [ -n "${BATCH:-}" ]; then
  OVERRIDES+=(--train.global_batch_size="$BATCH")
fi
read -r -a EXTRA <<< "${ARGS:-}"
OVERRIDES+=("${EXTRA[@]}")
DOMAINS=(math code chat heldout_math heldout_code heldout_chat)
for d in "${DOMAINS[@]}"; do
  if [ ! -f "$WORK/data/$d/manifest.json" ]; then
    mkdir -p "$WORK/data/$d.tmp"
    cp data/campaign/$d/manifest.json "$WORK/data/$d.tmp/"   # first: it lists only finished shards
    cp -l data/campaign/$d/shard_*.npz "$WORK/data/$d.tmp/"
    mv "$WORK/data/$d.tmp" "$WORK/data/$d"
  fi
  if [ "${FEATURES:-cached}" = cached ] || [[ $d == heldout_* ]]; then
    dspark-jax prepare-features --config $CONFIG --data "$WORK/data/$d" --output "$WORK/features/$d"
  fi
done
tuple() { local out="("; for d in "$@"; do out+="'$WORK/$d',"; done; echo "$out)"; }
TRAIN_FEATURES=()
if [ "${FEATURES:-cached}" = cached ]; then
  TRAIN_FEATURES=(--train.feature_dir="$(tuple features/math features/code features/chat)")
fi
dspark-jax train --config $CONFIG --workdir "$WORK" "${INIT[@]}" --train.max_steps="$STEPS" \
  "${OVERRIDES[@]}" \
  --train.data_dir="$(tuple data/math data/code data/chat)" \
  "${TRAIN_FEATURES[@]}" \
  --train.heldout_dir="$(tuple data/heldout_math data/heldout_code data/heldout_chat)" \
  --train.heldout_feature_dir="$(tuple features/heldout_math features/heldout_code features/heldout_chat)" \
  --train.heldout_batches=8 --train.heldout_every="${HELDOUT_EVERY:-50}" \
  --train.checkpoint_every="${CHECKPOINT_EVERY:-25}"
