#!/usr/bin/env bash
# Continues the campaign's DSpark run (issue 18) from the committed drafter on this machine or a
# new one, with the settings of its last runs (BENCHMARKS.md, "1,500 more steps"):
#
#   bash launch/smollm2_campaign/continue.sh [STEPS] [WORKDIR]   # defaults: 1500, runs/campaign10
#
# Rebuilds data/campaign from the committed answers when it is missing (`answers.py import`,
# needs ../shared/data), then runs train.sh, which caches the target's features (resumable; about
# 50 minutes of a 2-core CPU for the whole set) and trains from the packaged drafter
# dspark-smollm2-135m-campaign (dspark_jax/assets/) with a bfloat16 forward, peak learning rate
# 1.5e-4 (LR=... changes it: the restarts at 3e-4 up to step 11305 cost a dip of 0.05-0.07
# held-out tau each, 1.5e-4 one of 0.02, BENCHMARKS.md "A fifth 1,500 steps") and the held-out
# curve every 100 steps (LAYERS=4 grows its draft layers: train.sh). Rerun the same command
# after an interruption: the features and the
# Orbax checkpoints resume where they stopped. Afterwards, train.sh's header says how to commit
# the new drafter.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -f data/campaign/chat/manifest.json ] || python launch/smollm2_campaign/answers.py import
DTYPE=bfloat16 LR=${LR:-1.5e-4} HELDOUT_EVERY=100 bash launch/smollm2_campaign/train.sh "${1:-1500}" "${2:-runs/campaign10}"
