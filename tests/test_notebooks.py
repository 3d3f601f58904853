"""Every notebook runs headless, top to bottom, without an error."""

import os
import re

import nbformat
import pytest
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "notebooks")


@pytest.mark.multiworker
@pytest.mark.parametrize("name", [  # The multi-worker (41 s) and scaling (75 s) ones run in make soak.
    pytest.param(n, marks=pytest.mark.slow) if n in ("02_multi_worker.ipynb", "03_scaling.ipynb") else n
    for n in sorted(n for n in os.listdir(NOTEBOOKS) if n.endswith(".ipynb"))])
def test_notebook_runs(tmp_path, name):
    with open(os.path.join(NOTEBOOKS, name), encoding="utf-8") as f:
        notebook = nbformat.read(f, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), \
        "notebooks are committed without outputs"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    class IPCKernelManager(KernelManager):  # Unix sockets under tmp_path: no kernel port on the network.
        def __init__(self, **kwargs):
            super().__init__(transport="ipc", ip=str(tmp_path / "kernel"), **kwargs)

    NotebookClient(notebook, kernel_manager_class=IPCKernelManager, kernel_name="python3", timeout=600,
                   resources={"metadata": {"path": NOTEBOOKS}}).execute()
    text = "\n".join(str(o.get("text", "")) for c in notebook.cells for o in c.get("outputs", []))
    if name.startswith("02"):
        assert "succeeded | restarts: 1" in text
    if name.startswith("03"):
        assert len(re.findall(r":\s+\d+ examples/s", text)) == 4  # The four layouts.
        assert "results: " in text and "sweep.png" in text and "(2 pruned, 0 failed)" in text
