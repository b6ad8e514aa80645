# Warm start from the best ablation variant ($1), 100 more steps on the same snapshot.
cd "$(dirname "$0")/../.." && . .venv/bin/activate
D=runs/ablation
dspark-jax train --config configs/dspark_smollm2_135m.py --workdir runs/campaign_dspark \
  --train.init_from=$D/$1/drafter --train.markov_init=reference --train.max_steps=100 \
  --train.data_dir="('$D/data/0_math','$D/data/1_code','$D/data/2_chat')" \
  --train.feature_dir="('$D/features/0_math','$D/features/1_code','$D/features/2_chat')" \
  --train.heldout_dir="('$D/heldout/0_heldout_math','$D/heldout/1_heldout_code','$D/heldout/2_heldout_chat')" \
  --train.heldout_feature_dir="('$D/heldout_features/0_heldout_math','$D/heldout_features/1_heldout_code','$D/heldout_features/2_heldout_chat')" \
  --train.heldout_batches=8 --train.heldout_every=50 --train.checkpoint_every=25
