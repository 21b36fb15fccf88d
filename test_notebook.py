"""tutorial.ipynb runs from top to bottom, its training runs learn, and the committed copy reads on GitHub without
running.

Offline, CPU, 2-5 minutes (three 10-step training runs of the tiny model):  python -m pytest -q test_notebook.py
The kernel is "python3" started with this interpreter, in the repository root, so `import gmts` finds gmts.py.
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the names test parses flags: no hub

import json
import re
import shutil

import nbclient
import nbformat
import pytest

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


def _lab_flags():
    """The flags gmts_lab.py's parsers add (its commands' own; the rest go to gmts.py's parser)."""
    with open(os.path.join(HERE, "gmts_lab.py")) as f:
        return set(re.findall(r'add_argument\(\s*"(--[a-z][a-z0-9-]*)"', f.read()))


def test_every_flag_preset_task_and_key_the_notebook_names_exists():
    """The notebook's words, prose and code, read against gmts.py (and gmts_lab.py for its own
    flags): every --flag is a flag; every --preset a PRESETS key; every --task, TASKS["name"] and
    get_task("name") a task of TASKS; every TASKS["name"]["key"] and task["key"] an entry of
    TASKS, and so is every bare `word` in a sentence about TASKS; every --select a METHODS key;
    every --data a form gmts.py reads; every gmts.NAME an attribute of gmts; and every
    `python gmts.py ...` or `python gmts_lab.py ...` line parses as a run's config."""
    import shlex
    from transformers import HfArgumentParser
    import gmts
    nb = nbformat.read(NOTEBOOK, as_version=4)
    text = "\n".join(c.source for c in nb.cells)
    ours = set(HfArgumentParser(gmts.Config)._option_string_actions) | {"--preset"}
    lab = _lab_flags() - ours
    def named(flag):  # its values: '--flag value' in prose, '"--flag", "value"' in code
        pairs = re.findall(rf'(?<![\w-]){flag} ([a-z][\w@.:/=-]*[\w/])|"{flag}", "([^"]+)"', text)
        return [a or b for a, b in pairs]
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))
    assert flags - ours - lab == set() and len(flags & ours) >= 15, flags - ours - lab
    assert set(named("--preset")) <= set(gmts.PRESETS) and "cpu" in named("--preset")
    tasks = set(named("--task")) | set(re.findall(r'(?:TASKS\[|get_task\()"(\w+)"', text))
    assert tasks <= set(gmts.TASKS) and "countdown" in tasks, tasks
    keys = re.findall(r'TASKS\["(\w+)"\]\["(\w+)"\]', text)
    assert keys and all(key in gmts.TASKS[task] for task, key in keys), keys
    generic = set(re.findall(r'\btask\["(\w+)"\]', text))
    assert generic and all(key in entry for key in generic for entry in gmts.TASKS.values())
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for sentence in re.split(r"(?<=[.;:])\s", cell.source):
                if "TASKS" in sentence:
                    words = set(re.findall(r"`(\w+)`", sentence))
                    assert all(any(w in e for e in gmts.TASKS.values()) for w in words), words
    assert set(named("--select")) <= set(gmts.METHODS)
    for data in named("--data"):
        ok = gmts.data_kind(data) == "gen" or data.endswith((".jsonl", ".json", ".csv", ".parquet"))
        assert ok or (data.startswith("hf:") and gmts.hf_spec(data)), data
    attributes = set(re.findall(r"\bgmts\.([A-Za-z_]\w*)", text)) - {"py"}
    assert attributes and all(hasattr(gmts, a) for a in attributes), attributes - set(dir(gmts))
    lines = re.findall(r"^python (gmts|gmts_lab)\.py ([^#\n]*)", text, re.M)
    assert {prog for prog, _ in lines} == {"gmts", "gmts_lab"}
    for prog, line in lines:
        argv = shlex.split(line)
        if prog == "gmts_lab":  # its command, then its own flags (each with a value) go
            argv = argv[1:]
            for flag in lab & set(argv):
                i = argv.index(flag)
                del argv[i:i + 2]
        gmts.check_config(gmts.parse_args(argv))
