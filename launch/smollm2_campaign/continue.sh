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
# 3e-4 (LR=... changes it: its restarts dip deeper, 0.04-0.08 held-out tau, than 1.5e-4's
# 0.02-0.035, but its 1,500-step segments gained 0.21-0.24 tau per e-fold of the steps against
# 1.5e-4's 0.17-0.18; BENCHMARKS.md "1,500 more steps at peak 3e-4") and the held-out
# curve every 100 steps (LAYERS=4 grows its draft layers: train.sh). Rerun the same command
# after an interruption: the features and the
# Orbax checkpoints resume where they stopped. Afterwards, train.sh's header says how to commit
# the new drafter.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -f data/campaign/chat/manifest.json ] || python launch/smollm2_campaign/answers.py import
DTYPE=bfloat16 LR=${LR:-3e-4} HELDOUT_EVERY=100 bash launch/smollm2_campaign/train.sh "${1:-1500}" "${2:-runs/campaign10}"
