"""The engine on meshes of 8 simulated CPU devices gives the single-device output: through
``generate`` (autoregressive and speculative) and driven as a server.

The device count is fixed when JAX initialises, so the run happens in a subprocess started with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (``conftest.run_on_cpu_devices``); it
prints one JSON report.
"""

import textwrap

import pytest

from conftest import run_on_cpu_devices

pytestmark = pytest.mark.slow  # 8 simulated devices in a subprocess; CI runs -m slow

SCRIPT = textwrap.dedent(r'''
    import json
    import jax
    import dspark_jax
    from dspark_jax import sharding
    from dspark_jax.engine import Engine
    from dspark_jax.target import init_target

    assert len(jax.devices()) == 8
    CONFIG = dict(architectures=["Qwen3ForCausalLM"], vocab_size=64, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=8, eos_token_id=3)
    PROMPTS = [[5, 9, 11, 7], [4, 8, 15, 16, 23, 42, 7, 6, 10, 12], [17], [30, 31]]

    def run():
        target = init_target(CONFIG, seed=1)
        drafter = dspark_jax.init_drafter(target, seed=2)
        out = dspark_jax.generate(target, PROMPTS, max_new_tokens=16, drafter=drafter)
        ar = dspark_jax.generate(target, PROMPTS, max_new_tokens=16)
        assert [r.token_ids for r in ar] == [r.token_ids for r in out]
        q_kernel = target.state["layers"]["self_attn"]["q_proj"]["kernel"].get_value()
        spec = getattr(q_kernel.sharding, "spec", None)
        up_kernel = drafter.state["layers"]["mlp"]["up_proj"]["kernel"].get_value()
        dspec = getattr(up_kernel.sharding, "spec", None)
        return [r.token_ids for r in out], str(spec), str(dspec)

    def serve():
        """Continuous batching: 5 greedy requests through 4 slots, and one sampled request."""
        target = init_target(CONFIG, seed=1)
        drafter = dspark_jax.init_drafter(target, seed=2)
        engine = Engine(target, drafter, slots=4, max_len=64)
        requests = [engine.submit(p, max_new_tokens=12) for p in PROMPTS + [[6, 6, 6]]]
        sampled = engine.submit([9, 8, 7], max_new_tokens=12, temperature=1.0)
        engine.run()
        k = engine._caches.target.k
        return ([r.tokens for r in requests], len(sampled.tokens),
                str(getattr(k.sharding, "spec", None)))

    report = {"single": run(), "serve_single": serve()}
    with jax.set_mesh(sharding.make_mesh((2, 1, 4))):  # data and tensor parallel
        report["(2, 1, 4)"] = run()
        report["serve_mesh"] = serve()
    print("REPORT " + json.dumps(report))
''')


def test_greedy_on_meshes_equals_single_device():
    """generate and the engine driven as a server on a (2, 1, 4) mesh."""
    report = run_on_cpu_devices(["-c", SCRIPT])
    single_tokens = report.pop("single")[0]
    served, served_sampled, _ = report.pop("serve_single")
    tokens, sampled_len, cache_spec = report.pop("serve_mesh")
    assert tokens == served  # greedy: the same tokens
    assert 0 < sampled_len <= 12 and 0 < served_sampled <= 12  # a sampled request completes too
    assert "data" in cache_spec and "tensor" in cache_spec, cache_spec  # rows and kv heads
    for shape, (tokens, target_spec, drafter_spec) in report.items():
        assert tokens == single_tokens, shape
        assert "tensor" in target_spec and "tensor" in drafter_spec, (shape, target_spec, drafter_spec)
