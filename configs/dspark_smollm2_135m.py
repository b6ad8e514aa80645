"""DSpark drafter for the embedded default target SmolLM2-135M-Instruct, sized to train on a CPU.

Target: 30 layers, d = 576, 9 heads / 3 kv heads (head dim 64), MLP 1536, V = 49152, tied
embeddings.

* Taps 1, 8, 14, 21, 27: five layers spread like DeepSpec's (first at 1, last at L - 3), never
  the final layer.
* Mask: the tokenizer uses all 49152 embedding rows, so there is no spare row to borrow as
  DeepSpec does with Qwen3's 151669; the drafter trains its own mask vector. mask_token_id
  49151 (the last row, a rare BPE merge) is only the id written into exported checkpoints.
* Size: 2 draft layers (3.5M parameters each) and Markov rank 32 (2 x 49152 x 32 = 3.1M) keep
  the drafter at 12M trainable parameters, 24 MB in bfloat16 without the target's embedding
  and LM head (the checkpoint committed under checkpoints/). Per step the cost is dominated by
  the frozen target forward and the full-vocabulary logits of the sampled blocks (64 anchors x 7
  slots x 49152). Training: 4 packed rows of 512 tokens with 64 anchor slots each per step.
  Measured on a shared 2-core CPU: about 18 s per step, so the default 150 steps take about 45
  minutes (--train.max_steps to change).
"""

from dspark_jax import experiment


def get_config():
    return experiment.smollm2_dspark()
