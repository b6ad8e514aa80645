"""The DFlash baseline for SmolLM2-135M-Instruct: configs/dspark_smollm2_135m.py without the
Markov and confidence heads (markov_rank 0), trained with cross-entropy only on the same data
and step budget, for the DSpark-against-DFlash comparison in BENCHMARKS.md."""

from dspark_jax import experiment


def get_config():
    return experiment.smollm2_dflash()
