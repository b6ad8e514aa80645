"""Loading under a (data, fsdp, tensor) mesh of 8 simulated CPU devices.

The device count is fixed when JAX initialises, so the checks run in a subprocess started with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (``conftest.run_on_cpu_devices``); it
prints one JSON report.
"""

from __future__ import annotations

import textwrap

import pytest
from conftest import run_on_cpu_devices

pytestmark = pytest.mark.slow  # 8 simulated devices in a subprocess; CI runs -m slow

transformers = pytest.importorskip("transformers")

SCRIPT = textwrap.dedent(r'''
    import json, sys
    import jax
    import numpy as np
    from flax import nnx
    import dspark_jax
    from dspark_jax import engine, sharding

    folder = sys.argv[1]
    assert len(jax.devices()) == 8, jax.devices()
    rng = np.random.default_rng(0)
    lengths = [12, 5, 9, 1]
    ids = np.zeros((len(lengths), 12), np.int64)
    mask = np.zeros(ids.shape, np.int64)
    for i, n in enumerate(lengths):
        ids[i, :n], mask[i, :n] = rng.integers(3, 128, n), 1

    single = dspark_jax.load_target(folder)
    ref = single.logits(ids, mask)
    PROMPTS = [[5, 6, 7], [9] * 11]
    ref_gen = [r.token_ids for r in dspark_jax.generate(single, PROMPTS, max_new_tokens=6)]
    report = {"single_devices": len(next(iter(jax.tree.leaves(single.state))).sharding.device_set),
              "ref_abs_max": float(np.abs(ref).max())}
    for shape in [(2, 1, 4), (1, 2, 4)]:
        mesh = sharding.make_mesh(shape)
        with jax.set_mesh(mesh):
            target = dspark_jax.load_target(folder)
            logits = target.logits(ids, mask)
            try:  # reuses the program compiled above for the single-device parameters
                gen = [r.token_ids for r in dspark_jax.generate(target, PROMPTS, max_new_tokens=6)]
            except Exception as e:
                gen = f"{type(e).__name__}: {str(e)[:300]}"
            engine.clear_compiled_programs()
            gen_fresh = [r.token_ids for r in dspark_jax.generate(target, PROMPTS, max_new_tokens=6)]
        real = mask.astype(bool)
        specs = {}
        for path, var in nnx.to_flat_state(target.state):
            value = var.get_value()
            specs["/".join(map(str, path))] = {
                "spec": [None if a is None else (list(a) if isinstance(a, tuple) else a)
                         for a in value.sharding.spec],
                "devices": len(value.sharding.device_set),
                "shard_shape": list(value.addressable_shards[0].data.shape),
                "shape": list(value.shape),
            }
        report[str(shape)] = {
            "max_diff": float(np.max(np.abs(logits[real] - ref[real]))),
            "generation": gen,
            "generation_fresh_programs": gen_fresh,
            "reference_generation": ref_gen,
            "params": specs,
        }
    print("REPORT " + json.dumps(report))
''')


@pytest.fixture(scope="module")
def report(tmp_path_factory, make_hf_checkpoint):
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    root = tmp_path_factory.mktemp("sharding")
    folder = root / "model"
    make_hf_checkpoint(config, folder, seed=5)
    script = root / "check_sharding.py"
    script.write_text(SCRIPT)
    return run_on_cpu_devices([str(script), str(folder)], timeout=300)


MESHES = ["(2, 1, 4)", "(1, 2, 4)"]


def test_single_device_reference(report):
    assert report["single_devices"] == 1
    assert report["ref_abs_max"] > 0.5


@pytest.mark.parametrize("mesh", MESHES)
def test_logits_equal_single_device(report, mesh):
    assert report[mesh]["max_diff"] <= 1e-5


@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_generation_equals_single_device(report, mesh):
    """Greedy decoding with the sharded parameters (compiled for them) gives the same tokens."""
    assert report[mesh]["generation_fresh_programs"] == report[mesh]["reference_generation"]


@pytest.mark.parametrize("mesh", MESHES)
def test_generation_after_single_device_generation(report, mesh):
    assert report[mesh]["generation"] == report[mesh]["reference_generation"]


@pytest.mark.parametrize("mesh", MESHES)
def test_parameters_are_sharded(report, mesh):
    params = report[mesh]["params"]
    fsdp = int(mesh.strip("()").split(",")[1])
    q = params["layers/self_attn/q_proj/kernel"]  # [layers, embed, q_heads]
    assert q["spec"][2] == "tensor", q
    assert q["devices"] == 8
    assert q["shard_shape"] == [2, 64 // fsdp, 64 // 4], q
    k = params["layers/self_attn/k_proj/kernel"]  # 2 kv heads * 16 = 32 columns over 4
    assert k["spec"][2] == "tensor" and k["shard_shape"][2] == 8, k
    down = params["layers/mlp/down_proj/kernel"]  # [layers, mlp, embed]
    assert down["spec"][1] == "tensor" and down["shard_shape"] == [2, 128 // 4, 64 // fsdp], down
    assert params["layers/self_attn/q_proj/bias"]["spec"][1] == "tensor"
    assert params["embed_tokens/embedding"]["shard_shape"] == [128 // 4, 64 // fsdp]
    assert params["lm_head"]["shard_shape"] == [64 // fsdp, 128 // 4]
    if fsdp > 1:
        assert q["spec"][1] == "fsdp", q
    # Norm weights and the layers axis stay replicated.
    assert params["norm/weight"]["shard_shape"] == [64]
    assert all(p["spec"][0] is None for k, p in params.items() if k.startswith("layers/"))
