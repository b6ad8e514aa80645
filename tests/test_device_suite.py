"""The accelerator suite (benchmarks/device_suite.py) stays runnable: its CPU dry run (--smoke)
goes through every section and writes one JSON with every section's numbers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # about two minutes of compiles

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "device_suite.py"


def test_smoke_run_fills_every_section(tmp_path):
    output = tmp_path / "suite.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--output", str(output),
                           "--cache-attention", "einsum", "pallas"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(output.read_text())
    for section in ("decode", "sps", "speculative", "train", "attention"):
        assert "error" not in result[section], result[section]
    assert result["decode"]["batch_1"]["tokens_per_s"] > 0
    assert result["sps"]["decode_steps"]["1"] == 1.0
    assert set(result["sps"]["curves"]) == {"einsum", "pallas"}  # the kernel in interpret mode
    assert result["sps"]["pallas_speedup"]["8"] > 0
    assert result["speculative"]["batch_1"]["draft_ms"] > 0
    assert result["train"]["flops_per_step"] > 0 and result["train"]["mfu"] > 0
    attention = result["attention"]
    assert attention["fused"] == "xla"
    for route in ("xla", "xla_packed"):  # the fused routes, as a mask and as segment lengths
        assert attention[route + "_max_abs_diff"] < 1e-4 and attention[route + "_speedup"] > 0
