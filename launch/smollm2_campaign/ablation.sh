# The recipe ablation of BENCHMARKS.md (issue 18): four starts, 30 steps each, one data snapshot.
# Needs the feature caches of the snapshot folders (dspark-jax prepare-features on
# runs/ablation/data/* and runs/ablation/heldout/*, see BENCHMARKS.md).
cd "$(dirname "$0")/../.." && . .venv/bin/activate
python benchmarks/recipe_ablation.py --config configs/dspark_smollm2_135m.py \
  --data data/campaign/math data/campaign/code data/campaign/chat \
  --feature-dir runs/ablation/features/0_math runs/ablation/features/1_code runs/ablation/features/2_chat \
  --heldout data/campaign/heldout_math data/campaign/heldout_code data/campaign/heldout_chat \
  --heldout-feature-dir runs/ablation/heldout_features/0_heldout_math runs/ablation/heldout_features/1_heldout_code runs/ablation/heldout_features/2_heldout_chat \
  --steps 30 --workdir runs/ablation --set train.heldout_batches=8 \
  --variant reference= \
  --variant zero_w2=train.markov_init=zero_w2 \
  --variant bigram=train.markov_init=bigram \
  --variant "bigram+layers=train.markov_init=bigram,train.draft_layers_from=(28,29)"
