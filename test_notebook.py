"""tutorial.ipynb runs from top to bottom, and the committed copy reads on GitHub without running.

Offline, CPU, about 2-3 minutes (the notebook warms up and trains a tiny model):  python -m pytest -q test_notebook.py
The kernel is "python3" started with this interpreter, in the repository root, so `import gmts` finds gmts.py.
"""
import os
import shutil

import nbclient
import nbformat

HERE = os.path.dirname(os.path.abspath(__file__))
NOTEBOOK = os.path.join(HERE, "tutorial.ipynb")
MAX_BYTES = 2 * 1024 * 1024  # GitHub renders it quickly; the figures are PNGs at modest DPI
MIN_FIGURES = 4  # entropy vs gradient norm, the kept tokens, the zero-advantage budget, the training curves


def outputs(nb):
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


def figures(nb):
    return [o for o in outputs(nb) if "image/png" in o.get("data", {})]


def test_committed_notebook_has_its_outputs_and_is_small():
    assert os.path.getsize(NOTEBOOK) < MAX_BYTES, f"{os.path.getsize(NOTEBOOK):,} bytes"
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code), "commit the notebook executed, with its outputs"
    assert not [o for o in outputs(nb) if o.output_type == "error"]
    stderr = [o.text for o in outputs(nb) if o.output_type == "stream" and o.name == "stderr"]
    assert not stderr, f"noisy stderr in the committed outputs: {stderr[0][:300]!r}"
    assert len(figures(nb)) >= MIN_FIGURES


def test_notebook_executes(tmp_path):
    copy = tmp_path / "tutorial.ipynb"
    shutil.copy(NOTEBOOK, copy)
    nb = nbformat.read(copy, as_version=4)
    for c in nb.cells:  # start from nothing: the figures checked below must come from this run
        if c.cell_type == "code":
            c.outputs, c.execution_count = [], None
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": HERE}})
    try:
        client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error
    finally:
        nbformat.write(nb, copy)  # the executed copy stays in tmp_path for a look after a failure
    assert len(figures(nb)) >= MIN_FIGURES
