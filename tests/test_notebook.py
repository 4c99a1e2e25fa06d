"""The Colab notebook runs end to end (nbclient, a fresh kernel): the demo pair and SmolLM2 from
its GGUF. Cells tagged `skip-ci` (pip installs, the hub download) are left out: the suite has no
network. The kernel shares the suite's persistent compilation cache."""

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "colab", "ouroboros_jax_quickstart.ipynb")


def test_notebook_runs(smollm2_gguf_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    skipped = [c for c in nb.cells if "skip-ci" in c.get("metadata", {}).get("tags", [])]
    assert len(skipped) == 2  # the install cell and the hub download, nothing else
    nb.cells = [c for c in nb.cells if c not in skipped]
    # the kernel: this checkout, one CPU device, no network, the suite's compilation cache
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", os.path.join(ROOT, ".jax_cache"))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": ROOT}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                      for o in c.get("outputs", []))
    assert "identical to vanilla: True" in outputs
    assert "Paris" in outputs
    assert "llama-2-70b" in outputs
