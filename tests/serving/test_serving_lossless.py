"""The engine's output law is the target's (chi-square on the first three tokens against the exact
law over a 16-token vocabulary): with the production scheduler cutting budgets across requests,
and with it run for each slot alone on a drafter whose confidences depend on the drafted
tokens (paper Appendix A), where a new request must add nothing of its own block to the
capacity."""

import pytest

import law
from dspark_jax.engine import Engine


def _serve(engine, n, max_new_tokens):
    requests = [engine.submit(law.PROMPT, max_new_tokens=max_new_tokens, temperature=1.0)
                for _ in range(n)]
    engine.run()
    return requests


def _chi2(target, requests, positions):
    """(chi2, dof, bound) of the tokens at ``positions`` against the target's exact law."""
    return law.chi_square([[r.tokens[i] for i in positions] for r in requests],
                          law.marginal_law(target, positions))


@pytest.mark.slow  # chi-square over 20,000 requests; CI runs -m slow
def test_production_scheduler_is_lossless():
    target, drafter = law.law_models()
    slots, n = 128, 20000
    # Step-shaped steps/s over forward tokens 1..512: the capacity lands inside the batch, so the
    # budget is cut across requests by their current confidences.
    sps = [1.0] * 161 + [0.8] * 100 + [0.45] * 252
    engine = Engine(target, drafter, slots=slots, max_len=8, policy="production",
                    policy_params={"sps": sps}, buckets=(128, 256), seed=3)
    # 5 tokens: requests of every age share a step, so young ones (whose own blocks add nothing
    # to the capacity) get budget sized by older ones.
    requests = _serve(engine, n, 5)
    budgets = (sum(r.counters["proposal_len_sum"] for r in requests)
               / sum(r.counters["rounds"] for r in requests))
    assert 0.1 < budgets < 2.7, budgets  # neither nothing nor everything was verified
    for positions in ((0, 1, 2), (3, 4)):
        chi2, dof, bound = _chi2(target, requests, positions)
        assert chi2 < bound, (positions, chi2, dof)


@pytest.mark.slow  # a chi-square law test over many sequences
def test_new_requests_add_nothing_of_their_block_to_the_capacity():
    """Production per slot with token-dependent confidences: a newly admitted request sized
    from its own first block would verify x_1 only when x_1 is even and bias t2."""
    target, drafter = law.law_models(token_dependent_confidence=True)
    engine = Engine(target, drafter, slots=64, max_len=8, policy=law.production_per_request,
                    policy_params={"sps": law.ONE_REQUEST_SPS}, buckets=(64, 128), seed=3)
    chi2, dof, bound = _chi2(target, _serve(engine, 4000, 3), (0, 1, 2))
    assert chi2 < bound, (chi2, dof)
