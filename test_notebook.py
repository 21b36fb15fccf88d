"""tutorial.ipynb runs from top to bottom, its training runs learn, and the committed copy reads on GitHub without
running.

Offline, CPU, about 2 minutes (three 10-step training runs of the tiny model):  python -m pytest -q test_notebook.py
The kernel is "python3" started with this interpreter, in the repository root, so `import gmts` finds gmts.py.
"""
import json
import os
import shutil

import nbclient
import nbformat

HERE = os.path.dirname(os.path.abspath(__file__))
NOTEBOOK = os.path.join(HERE, "tutorial.ipynb")
MAX_BYTES = 2 * 1024 * 1024  # GitHub renders it quickly; the figures are PNGs at modest DPI
MIN_FIGURES = 4  # entropy vs gradient norm, the kept tokens, the zero-advantage budget, the training curves
MIN_GAIN = 0.10  # held-out accuracy the GMTS run must gain over its warm start (measured: +17 points, seed 0)


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
    assert any("train(" in c.source and "score_fn=" in c.source for c in code), "Your turn trains the reader's score"


def test_notebook_executes_and_gmts_learns(tmp_path, monkeypatch):
    copy = tmp_path / "tutorial.ipynb"
    shutil.copy(NOTEBOOK, copy)
    nb = nbformat.read(copy, as_version=4)
    for c in nb.cells:  # start from nothing: the figures and results checked below must come from this run
        if c.cell_type == "code":
            c.outputs, c.execution_count = [], None
    results = tmp_path / "results.json"
    monkeypatch.setenv("GMTS_NB_RESULTS", str(results))  # the kernel inherits this process's environment
    monkeypatch.delenv("GMTS_NB_DOCS", raising=False)  # never rewrite docs/kept_tokens.png from a test
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": HERE}})
    try:
        client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error
    finally:
        nbformat.write(nb, copy)  # the executed copy stays in tmp_path for a look after a failure
    assert len(figures(nb)) >= MIN_FIGURES
    res = json.loads(results.read_text())
    assert set(res) == {"gmts", "entropy", "my_score"}
    acc = {int(step): a for step, a in res["gmts"]["eval_acc"].items()}
    first, last = acc[0], acc[max(acc)]
    assert max(acc) == 10 and last >= first + MIN_GAIN, f"GMTS held-out accuracy {first:.3f} -> {last:.3f}"
    assert all(z == 0 for z in res["gmts"]["zero_adv_selected_frac"])  # GMTS keeps nothing of an A = 0 answer
