"""`dspark-jax demo`: the packaged drafter answers three ways (autoregressive, full block, the
production scheduler with this machine's steps/s profile), matches autoregressive output,
reports, and fails when the tokens differ."""

import dataclasses

import pytest

from dspark_jax import cli, demo

pytestmark = pytest.mark.slow  # the real SmolLM2 end to end, SPS profile included; CI runs -m slow


def test_demo_runs_and_reports(smollm2, smollm2_cache, monkeypatch, capsys):
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(smollm2_cache))
    rows = demo.run_demo(prompts=["What is 3 + 4?"], max_new_tokens=16, progress=False)
    (row,) = rows
    assert row.ar.token_ids and row.ar.wall_s > 0 and not demo.mismatches(rows)
    for way in demo.WAYS:
        assert row.identical(way) and row.spec[way].tau >= 1.0 and row.spec[way].wall_s > 0
    assert row.spec["full"].verified == 7.0 and row.spec["production"].verified < 7.0
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
