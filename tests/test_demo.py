"""`dspark-jax demo`: the packaged drafter answers, matches autoregressive output, reports."""

from dspark_jax import cli
from dspark_jax.demo import format_report, run_demo


def test_demo_runs_and_reports(smollm2, smollm2_cache, monkeypatch, capsys):
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(smollm2_cache))
    rows = run_demo(prompts=["What is 3 + 4?"], max_new_tokens=16, progress=False)
    assert len(rows) == 1 and rows[0].identical and rows[0].new_tokens > 0
    assert rows[0].tau >= 1.0 and rows[0].ar_s > 0 and rows[0].spec_s > 0
    report = format_report(rows)
    assert "| all |" in report and "What is 3 + 4?" in report
    assert cli.main(["demo", "--prompt", "Name a color.", "--max-new-tokens", "8"]) == 0
    assert "speedup" in capsys.readouterr().out
