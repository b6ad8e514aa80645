#!/usr/bin/env bash
# The paper's comparison at one budget (issue 18): a DSpark and a DFlash drafter of the embedded
# default target, both fresh, trained the same number of steps on the same campaign data (the
# same snapshot, seed and batches; online target features), each with its held-out curve:
#
#   bash launch/smollm2_campaign/compare.sh [STEPS] [WORKDIR]     # defaults: 300, runs/compare
#
# DSpark takes the campaign's recipe (bigram-SVD Markov start), DFlash the same backbone
# without the head (configs/dflash_smollm2_135m.py). Each run resumes from its own checkpoints,
# so rerunning the script after an interruption continues where it stopped. On a new machine it
# first rebuilds data/campaign from the committed answers (`answers.py import`, needs
# ../shared/data). DRAFTERS=dspark or DRAFTERS=dflash trains only that one (DFlash reads
# DSpark's data snapshot: DSpark first).
# Afterwards:
#   python benchmarks/learning_curve.py --workdir WORKDIR/dspark --label DSpark --offset 0 \
#       --workdir WORKDIR/dflash --label DFlash --offset 0 --output benchmarks/results/compare_curve.json
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${1:-300}
WORK=${2:-runs/compare}
DRAFTERS=${DRAFTERS:-dspark dflash}
[ -f data/campaign/chat/manifest.json ] || python launch/smollm2_campaign/answers.py import
if [[ " $DRAFTERS " == *" dspark "* ]]; then
  FEATURES=${FEATURES:-online} START=bigram CONFIG=configs/dspark_smollm2_135m.py \
    bash launch/smollm2_campaign/train.sh "$STEPS" "$WORK/dspark"
fi
[[ " $DRAFTERS " == *" dflash "* ]] || exit 0
# DFlash reads DSpark's data snapshot and held-out features (the same taps).
mkdir -p "$WORK/dflash"
for shared in data features; do
  link=$WORK/dflash/$shared
  if [ -e "$link" ] && [ ! -L "$link" ]; then
    echo "$link exists and is not a link to ../dspark/$shared: DFlash would not see DSpark's data" >&2
    exit 2
  fi
  ln -sfn "../dspark/$shared" "$link"
done
FEATURES=${FEATURES:-online} START=reference CONFIG=configs/dflash_smollm2_135m.py \
  bash launch/smollm2_campaign/train.sh "$STEPS" "$WORK/dflash"
