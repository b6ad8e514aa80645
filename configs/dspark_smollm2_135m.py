"""DSpark drafter for the embedded default target SmolLM2-135M-Instruct, sized to train on a CPU.

Target: 30 layers, d = 576, 9 heads / 3 kv heads (head dim 64), MLP 1536, V = 49152, tied
embeddings.

* Taps 1, 8, 14, 21, 27: five layers spread like DeepSpec's (first at 1, last at L - 3), never
  the final layer.
* Mask: the tokenizer uses all 49152 embedding rows, so there is no spare row to borrow as
  DeepSpec does with Qwen3's 151669; the drafter trains its own mask vector. mask_token_id
  49151 (the last row, a rare BPE merge) is only the id written into exported checkpoints.
* Size: 2 draft layers (3.5M parameters each) and Markov rank 64 (2 x 49152 x 64 = 6.3M) keep
  the drafter around 15M trainable parameters. Per step the cost is dominated by the frozen
  target forward and the full-vocabulary logits of the sampled blocks (64 anchors x 7 slots x
  49152). Training: 4 packed rows of 512 tokens with 64 anchor slots each per step. Measured
  on a shared 2-core CPU (with another job running): about 18 s per step, so the default 150
  steps take about 45 minutes (--train.max_steps to change).
"""

from dspark_jax import presets


def get_config():
    return presets.experiment(
        "smollm2-135m-instruct",
        drafter=dict(target_layer_ids=(1, 8, 14, 21, 27), mask_token_id=49151, block_size=7,
                     num_layers=2, markov_rank=64, head="markov", confidence_head=True,
                     confidence_head_with_markov=True, trainable_mask_embedding=True,
                     anchor_predicts=True, num_anchors=64),
        train=dict(presets.DSPARK_TRAIN, learning_rate=1e-3, global_batch_size=4, epochs=1,
                   max_length=512, max_steps=150, pack_length=512, anchors_per_row=64,
                   anchor_chunk=16, log_every=5, checkpoint_every=50))
