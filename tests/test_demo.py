"""`dspark-jax demo`: the packaged drafter answers three ways (autoregressive, full block, the
production scheduler with this machine's steps/s profile), matches autoregressive output,
reports, and fails when the tokens differ."""

import dataclasses

import pytest

from dspark_jax import cli, demo


@pytest.mark.slow  # the real SmolLM2 end to end, SPS profile included; CI runs -m slow
def test_demo_runs_and_reports(smollm2, smollm2_cache, monkeypatch, capsys):
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(smollm2_cache))
    rows = demo.run_demo(prompts=["What is 3 + 4?"], max_new_tokens=16, progress=False)
    (row,) = rows
    assert row.ar.token_ids and row.ar.wall_s > 0 and not demo.mismatches(rows)
    for way in demo.WAYS:
        assert row.identical(way) and row.spec[way].tau >= 1.0 and row.spec[way].wall_s > 0
    assert row.spec["full"].verified == 7.0 and 0 < row.spec["production"].verified <= 7.0
    report = demo.format_report(rows)
    assert "| all |" in report and "What is 3 + 4?" in report and "production: tau" in report
    assert cli.main(["demo", "--prompt", "Name a color.", "--max-new-tokens", "8"]) == 0
    assert "speedup" in capsys.readouterr().out

    # Speculative tokens that differ from autoregressive ones fail the command.
    spec = dict(row.spec, production=dataclasses.replace(row.spec["production"],
                                                         token_ids=row.ar.token_ids[:-1] + [0]))
    broken = [dataclasses.replace(row, spec=spec)]
    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: broken)
    assert cli.main(["demo"]) == 1
    err = capsys.readouterr().err
    assert "FAILED: prompt 1, production: speculative tokens differ" in err


def test_each_way_keeps_its_fastest_repeat_and_reports_changed_tokens(monkeypatch):
    """Repeats alternate the ways; a way's time is its fastest repeat, its tokens the first
    repeat's, and tokens that change between repeats fail the demo."""
    from types import SimpleNamespace

    calls, dtypes, draft_dtypes = [], [], []
    walls = {"autoregressive": [3.0, 2.0], "full": [1.0, 4.0], "production": [5.0, 1.5]}
    drift = {"production": True}  # its second repeat emits other tokens

    def fake_generate(target, prompts, max_new_tokens, drafter=None, verify=None, verify_params=None,
                      weight_dtype=None, draft_weight_dtype=None):
        dtypes.append(weight_dtype)
        draft_dtypes.append(draft_weight_dtype)
        way = verify or "autoregressive"
        repeat = sum(c == way for c in calls)
        calls.append(way)
        tokens = [1, 2, 3] + ([9] if drift.get(way) and repeat else [])
        stats = {"wall_s": walls[way][repeat]}
        if verify:
            stats.update(rounds=2, tau=1.5, proposal_len=7.0 if verify == "full" else 1.0)
        return [SimpleNamespace(token_ids=tokens, text="one two three", stats=stats)]

    monkeypatch.setattr(demo, "generate", fake_generate)
    monkeypatch.setattr(demo, "load_target", lambda model: "target")
    monkeypatch.setattr(demo, "load_drafter", lambda drafter, target: "drafter")
    (row,) = demo.run_demo(prompts=["p"], repeats=2, sps=[1.0], weight_dtype="bfloat16",
                           progress=False)
    assert calls == ["autoregressive", "full", "production"] * 2
    assert dtypes == ["bfloat16"] * 6  # the demo's weight dtype reaches every way
    assert draft_dtypes == [None, "bfloat16", "bfloat16"] * 2  # bfloat16 drafter matrices
    assert (row.ar.wall_s, row.spec["full"].wall_s, row.spec["production"].wall_s) == (2.0, 1.0, 1.5)
    assert row.answer == "one two three" and row.spec["production"].token_ids == [1, 2, 3]
    assert demo.mismatches([row]) == ["prompt 1, production: the tokens changed between the demo's repeats"]
    assert row.identical("full") and not row.identical("production")  # the report's "same" column
    drift.clear()
    calls.clear()
    (row,) = demo.run_demo(prompts=["p"], repeats=2, sps=[1.0], progress=False)
    assert not demo.mismatches([row])
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        demo.run_demo(prompts=["p"], repeats=0, sps=[1.0], progress=False)
