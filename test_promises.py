"""The seven promises of a gmts.py run (README, "What a run promises"), one section each, through the command line:
gmts.main(argv) in this process, or `python gmts.py ...` in a child where a kill, a signal or a second process is
the point. Offline, CPU:  python -m pytest -q test_promises.py

1 the CPU demo learns; 2 resume is exact; 3 checkpoints are model folders, atomic, the last two kept; 4 nothing that
is not the run's is replaced; 5 grading is bounded and never raises; 6 the published data files load; 7 errors are
one line from one place (exit 2 bad input, 1 a fault while running, 130 Ctrl-C).
"""
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import errno
import glob
import json
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import gmts

HERE = os.path.dirname(os.path.abspath(__file__))
ENV1 = dict(os.environ, OMP_NUM_THREADS="1")
TIMINGS = ("step_time_s", "tokens_per_s", "rollout_time_s", "grade_time_s")
# a tiny random model on easy countdown, trained hard enough (lr 1e-2) that every step moves the weights
SMALL = ["--model", "tiny", "--task", "countdown", "--data", "easy", "--short-prompt", "--prompts-per-step", "2",
         "--group-size", "4", "--max-new-tokens", "12", "--eval-size", "2", "--eval-every", "0", "--lr", "1e-2",
         "--warmup-steps", "0", "--threads", "1"]


def parity_reward(text, row):
    """Splits almost every group of the random tiny model: the parity of the answer's characters (DRIVER: the same)."""
    return float(sum(map(ord, text)) % 2)


@pytest.fixture
def parity(monkeypatch):
    monkeypatch.setitem(gmts.TASKS["countdown"], "reward", parity_reward)


def metrics(out):
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in gmts.read_metrics(str(out))]


def weights(folder):
    from safetensors.torch import load_file
    return load_file(os.path.join(folder, "model.safetensors"))


def same_weights(a, b):
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def snapshot(folder):
    """Every file's bytes under folder, by relative path."""
    return {os.path.relpath(os.path.join(d, f), folder): open(os.path.join(d, f), "rb").read()
            for d, _, names in os.walk(folder) for f in names}


def fails(capsys, argv, code):
    """gmts.main(argv) in this process ends with `code` and exactly one stderr line, no traceback -> that line."""
    with pytest.raises(SystemExit) as e:
        gmts.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == code and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gmts: error: "), err
    return lines[0]


# A child run: `python DRIVER WHERE gmts-flags...` trains with parity_reward and, by WHERE, SIGKILLs itself:
# "metrics" right after step 3's metrics line (before its checkpoint), "checkpoint" once ckpt-000004.tmp is complete
# (before its rename), "interrupt" sends itself SIGINT (Ctrl-C) after step 2's line; "none" runs to the end.
DRIVER = """
import os, signal, sys
sys.path.insert(0, {here!r})
import torch
import gmts

gmts.TASKS["countdown"]["reward"] = lambda text, row: float(sum(map(ord, text)) % 2)
where, argv = sys.argv[1], sys.argv[2:]
log, save = gmts.log_metrics, torch.save

def log_then(path, rec):
    log(path, rec)
    if where == "metrics" and rec["step"] == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    if where == "interrupt" and rec["step"] == 2:
        os.kill(os.getpid(), signal.SIGINT)

def save_then(obj, path, *a, **k):
    save(obj, path, *a, **k)
    if where == "checkpoint" and os.path.basename(os.path.dirname(str(path))) == "ckpt-000004.tmp":
        os.kill(os.getpid(), signal.SIGKILL)

gmts.log_metrics, torch.save = log_then, save_then
gmts.main(argv)
"""


def child(tmp_path, where, *argv, timeout=600):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(here=HERE))
    return subprocess.run([sys.executable, str(driver), where, *map(str, argv)], capture_output=True, text=True,
                          timeout=timeout, cwd=HERE, env=ENV1)


# ---- 1. the offline CPU demo learns --------------------------------------------------------------------------------


def test_the_cpu_demo_learns_in_a_short_run(tmp_path):
    """--preset cpu, cut to 10 steps (its lr schedule stretched over them): held-out greedy accuracy on its 256
    problems rises from the warm start's by a clear margin (the full 80 steps: README's figure, the slow test)."""
    out = tmp_path / "cpu"
    gmts.main(["--preset", "cpu", "--steps", "10", "--eval-every", "10", "--out", str(out)])
    recs = gmts.read_metrics(str(out))
    first, last = recs[0]["eval_acc"], recs[-1]["eval_acc"]
    assert [r["step"] for r in recs] == list(range(11)) and last >= first + 0.1, (first, last)  # measured: 0.273 -> 0.469
    assert os.path.isfile(out / "metrics.png")


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("GMTS_SLOW") != "1", reason="minutes long: GMTS_SLOW=1 runs it")
def test_the_cpu_demo_reproduces_the_readme_curve(tmp_path):
    """The README's main job, whole: `python gmts.py --preset cpu` from 0.273 to about 0.68 at step 80 (AVX2
    kernels: 0.691; AVX-512: 0.684; ATEN_CPU_CAPABILITY=avx2 gives the AVX2 digits anywhere)."""
    out = tmp_path / "cpu"
    r = subprocess.run([sys.executable, os.path.join(HERE, "gmts.py"), "--preset", "cpu", "--out", str(out)],
                       capture_output=True, text=True, cwd=HERE, env=ENV1, timeout=3600)
    assert r.returncode == 0, r.stderr
    accs = [rec["eval_acc"] for rec in gmts.read_metrics(str(out)) if "eval_acc" in rec]
    assert abs(accs[0] - 0.273) < 0.002 and 0.65 <= accs[-1] <= 0.72, accs


# ---- 2. resume is exact --------------------------------------------------------------------------------------------


def countdown_file(tmp_path, n=13):
    """n countdown rows in a data file: 2 held out, so 11 train and a pass of 2-row steps ends on a 1-row step."""
    path = tmp_path / "cd.jsonl"
    rows = gmts.load_rows("countdown", "easy", n, 7)
    path.write_text("".join(json.dumps({"nums": r["nums"], "target": r["target"]}) + "\n" for r in rows))
    return path


def test_a_killed_run_resumes_to_the_uninterrupted_one_epoch_order_included(tmp_path):
    """--data-order epoch over a data file, killed (SIGKILL: no handler runs) after a metrics line and again
    inside a checkpoint write; `--resume OUT` alone then gives the uninterrupted run's metrics line for line
    (timings aside) and its final weights bit for bit, the rows drawn coming from the checkpoint's state.pt."""
    data = countdown_file(tmp_path)
    run = [*SMALL, "--data", data, "--data-order", "epoch", "--steps", "8", "--save-every", "1"]
    ref, a, b = tmp_path / "ref", tmp_path / "a", tmp_path / "b"
    assert child(tmp_path, "none", *run, "--out", ref).returncode == 0
    want = metrics(ref)
    assert sum(r["grad_norm"] > 0 for r in want[1:]) >= 6  # the weights move: the comparison means something
    for where, out in (("metrics", a), ("checkpoint", b)):
        assert child(tmp_path, where, *run, "--out", out).returncode == -signal.SIGKILL
    assert [r["step"] for r in metrics(a)] == [0, 1, 2, 3] and gmts.checkpoints(str(a))[-1].endswith("ckpt-000002")
    assert (b / "ckpt-000004.tmp" / "state.pt").exists() and gmts.checkpoints(str(b))[-1].endswith("ckpt-000003")
    state = torch.load(a / "ckpt-000002" / "state.pt", weights_only=True)
    assert state["drawn"] == 4  # two steps of 2 rows
    for out in (a, b):
        r = child(tmp_path, "none", "--resume", out)
        assert r.returncode == 0, r.stderr
        assert metrics(out) == want and same_weights(out, ref)
        assert not glob.glob(str(out / "*.tmp")) and not glob.glob(str(out / "*.old"))


def test_resume_takes_only_the_flags_that_keep_the_run(tmp_path, capsys, parity):
    """With --resume, --steps (and --eval-every, --save-every, --device, --threads, --report-to) may be given;
    any other flag is refused in one line naming it, and the folder is left as it was."""
    out = tmp_path / "run"
    gmts.main([*SMALL, "--steps", "2", "--save-every", "1", "--out", str(out)])
    before = snapshot(out)
    for flag, value in (("--lr", "1e-3"), ("--select", "entropy"), ("--seed", "1"), ("--overwrite", None),
                        ("--preset", "smoke"), ("--out", str(tmp_path / "else"))):
        line = fails(capsys, ["--resume", out, flag, *([value] if value else [])], 2)
        assert flag in line and "--resume" in line, line
    line = fails(capsys, ["--resume", out, "--steps", "1"], 2)  # fewer steps than it has run: no silent end
    assert "--steps 1 is below the run's last saved step 2" in line, line
    assert snapshot(out) == before
    gmts.main(["--resume", str(out), "--steps", "3", "--eval-every", "3", "--threads", "1"])
    assert [r["step"] for r in metrics(out)] == [0, 1, 2, 3] and "eval_acc" in metrics(out)[-1]


# ---- 3. checkpoints are model folders, atomic, the last two kept ---------------------------------------------------


def test_checkpoints_are_model_folders_and_the_last_two_are_kept(tmp_path, parity):
    """After 4 steps saved each step: ckpt-000003 and ckpt-000004 only (renamed in whole, none half deleted);
    each loads as a model with AutoModelForCausalLM, and --model OUT/ckpt-000004 starts a new run from it."""
    from transformers import AutoModelForCausalLM
    out = tmp_path / "run"
    gmts.main([*SMALL, "--steps", "4", "--save-every", "1", "--out", str(out)])
    assert [os.path.basename(c) for c in gmts.checkpoints(str(out))] == ["ckpt-000003", "ckpt-000004"]
    assert sorted(n for n in os.listdir(out) if n.startswith("ckpt-")) == ["ckpt-000003", "ckpt-000004"]
    loaded = AutoModelForCausalLM.from_pretrained(out / "ckpt-000004")
    final = AutoModelForCausalLM.from_pretrained(out)  # the final model, in --out itself
    assert all(torch.equal(p, q) for p, q in zip(loaded.parameters(), final.parameters()))
    new = tmp_path / "new"
    gmts.main([*SMALL, "--model", str(out / "ckpt-000004"), "--steps", "1", "--out", str(new)])
    start = AutoModelForCausalLM.from_pretrained(new / "ckpt-000000")
    assert all(torch.equal(p, q) for p, q in zip(start.parameters(), loaded.parameters()))


def test_a_write_that_dies_leaves_the_newest_complete_checkpoint(tmp_path, parity, monkeypatch, capsys):
    """A save that fails half way (here: the disk fills while ckpt-000002.tmp is written) removes its half folder,
    and the run says which checkpoint it keeps; --resume goes on from it."""
    out = tmp_path / "run"
    save = torch.save

    def full_disk(obj, path, *a, **k):
        if "ckpt-000002.tmp" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return save(obj, path, *a, **k)
    monkeypatch.setattr(torch, "save", full_disk)
    line = fails(capsys, [*SMALL, "--steps", "3", "--save-every", "1", "--out", out], 1)
    assert "No space left on device" in line and "keeps ckpt-000001: continue with --resume" in line, line
    assert sorted(n for n in os.listdir(out) if n.startswith("ckpt-")) == ["ckpt-000000", "ckpt-000001"]
    monkeypatch.setattr(torch, "save", save)
    gmts.main(["--resume", str(out)])
    assert [r["step"] for r in metrics(out)] == [0, 1, 2, 3]


# ---- 4. nothing that is not the run's is replaced ------------------------------------------------------------------


def test_a_folder_that_holds_no_run_is_refused_untouched(tmp_path, capsys):
    mine = tmp_path / "mine"
    os.makedirs(mine / "sub")
    (mine / "notes.txt").write_text("mine")
    (mine / "metrics.jsonl").write_text("my own metrics\n")  # a run's name, but no run wrote it
    before = snapshot(mine)
    for extra in ([], ["--overwrite"]):
        line = fails(capsys, [*SMALL, "--steps", "1", "--out", mine, *extra], 2)
        assert "not a gmts run" in line, line
    assert snapshot(mine) == before and sorted(os.listdir(mine)) == ["metrics.jsonl", "notes.txt", "sub"]
    killed = tmp_path / "killed"  # a new run killed as it wrote its config leaves only these: a rerun goes in
    os.makedirs(killed)
    (killed / gmts.LOCK).write_text("")
    (killed / "run_config.json.tmp").write_text("{")
    gmts.main([*SMALL, "--steps", "1", "--out", str(killed)])
    assert [r["step"] for r in metrics(killed)] == [0, 1] and not (killed / "run_config.json.tmp").exists()


def test_a_run_needs_resume_or_overwrite_and_overwrite_keeps_the_users_files(tmp_path, capsys, parity):
    out = tmp_path / "run"
    gmts.main([*SMALL, "--steps", "2", "--save-every", "1", "--out", str(out)])
    (out / "my_notes.txt").write_text("mine")
    os.makedirs(out / "my_plots")
    before = snapshot(out)
    line = fails(capsys, [*SMALL, "--steps", "1", "--out", out], 2)
    assert f"--resume {out}" in line and "--overwrite" in line, line
    assert snapshot(out) == before
    gmts.main([*SMALL, "--steps", "1", "--overwrite", "--out", str(out)])
    assert [r["step"] for r in metrics(out)] == [0, 1]  # the new run alone
    assert [os.path.basename(c) for c in gmts.checkpoints(str(out))] == ["ckpt-000000", "ckpt-000001"]
    assert (out / "my_notes.txt").read_text() == "mine" and (out / "my_plots").is_dir()


def test_out_may_not_be_or_hold_the_model(tmp_path, capsys):
    model, tok = gmts.build_tiny()
    folder = tmp_path / "m"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    before = snapshot(tmp_path)
    for out in (folder, tmp_path):
        line = fails(capsys, [*SMALL, "--model", folder, "--out", out], 2)
        assert "--model folder" in line, line
    assert snapshot(tmp_path) == before


def test_one_process_writes_a_run_folder_at_a_time(tmp_path, capsys):
    """While another process holds the folder's lock (filelock), a second run there is refused in one line and
    changes nothing; once it lets go, the run goes in."""
    out = tmp_path / "run"
    os.makedirs(out)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time, filelock; l = filelock.FileLock(sys.argv[1]); "
                               "l.acquire(); print('held', flush=True); time.sleep(60)", str(out / gmts.LOCK)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        line = fails(capsys, [*SMALL, "--steps", "1", "--out", out], 2)
        assert "another process writes there now" in line, line
        assert os.listdir(out) == [gmts.LOCK]
    finally:
        holder.kill()
        holder.wait()
    gmts.main([*SMALL, "--steps", "1", "--out", str(out)])
    assert [r["step"] for r in metrics(out)] == [0, 1]


# ---- 5. grading is bounded and never raises --------------------------------------------------------------------


def test_grading_is_bounded_in_time_and_never_raises():
    """math-verify's own timeouts bound a LaTeX grade (a power tower it cannot finish), in the main thread; off it,
    a grade raises RunError (the caller's bug) instead of scoring 0 silently. No verifier raises on junk."""
    gmts.latex_equal.cache_clear()
    tower = "Working.\n\\boxed{9^{9^{9^{9}}}}"
    t = time.time()
    assert gmts.math_reward(tower, "9^{9^{9^{9}}}+1", latex=True) in (0.0, 1.0)
    assert time.time() - t < 4 * gmts.VERIFY_TIMEOUT_S
    for text in ("\\boxed{" * 5000, "<answer>" + "(" * 10000 + "</answer>", "\x00\ud800" * 100, "9" * 100_000):
        assert gmts.math_reward(text, "\\frac{1}{2}", latex=True) == 0.0
        assert gmts.countdown_reward(text, [1, 2, 3], 6) in (0.0, 0.1)
        assert gmts.logic_reward(text, {"Alice": True}) in (0.0, 0.1)
    found = []
    worker = threading.Thread(target=lambda: found.append(_grade_in_thread()))
    worker.start()
    worker.join()
    assert found == ["RunError"]


def _grade_in_thread():
    gmts.latex_equal.cache_clear()
    try:
        gmts.math_reward("\\boxed{x^2}", "x^{2}", latex=True)
    except gmts.RunError:
        return "RunError"
    return "graded"


# ---- 6. the published data files load -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(HERE, "testdata"))))
def test_every_published_layout_loads_without_flags(name):
    if not name.endswith(".jsonl"):
        pytest.skip("not a data file")
    path = os.path.join(HERE, "testdata", name)
    with open(path) as f:
        n = sum(1 for line in f if line.strip())
    rows = gmts.load_rows("math", path, 0)
    assert len(rows) == n and all(r["question"] and r["answer"] is not None for r in rows)


@pytest.mark.parametrize("row, lacks", [({"problem": "What is 1 + 1?"}, "answer"),
                                        ({"answer": "2", "solution": "1 + 1 = 2"}, "question")])
def test_a_row_without_a_question_or_an_answer_is_refused_naming_it(tmp_path, capsys, row, lacks):
    path = tmp_path / "d.jsonl"
    good = {"problem": "What is 2 + 2?", "answer": "4"}
    path.write_text("".join(json.dumps(r) + "\n" for r in (good, good, row, good)))
    out = tmp_path / "o"
    line = fails(capsys, ["--task", "math", "--model", "tiny", "--data", path, "--eval-size", "1",
                          "--prompts-per-step", "1", "--out", out], 2)
    assert f"{path} row 3 has no {lacks}" in line, line
    assert not os.path.exists(out) or os.listdir(out) in ([], [gmts.LOCK])


# ---- 7. errors are one line from one place -------------------------------------------------------------------------

BAD_INPUT = [  # (argv, a piece of the one line): each exit 2, before any work
    (["--rho", "2"], "--rho must be in (0, 1]"),
    (["--group-size", "1"], "--group-size must be >= 2"),
    (["--select", "nope"], "--select must be one of"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--steps", "many"], "--steps"),
    (["--loss-norm", "mean"], "--loss-norm"),
    (["--rsi-low", "1", "--rsi-high", "1", "--select", "rsi"], "--rsi-low 1.0 must be below --rsi-high"),
    (["--data", "{tmp}/missing.jsonl"], "missing.jsonl: cannot read it"),
    (["--data", "{tmp}/rows.txt"], "not a .jsonl, .json, .csv or .parquet file"),
    (["--data", "{tmp}/broken.jsonl"], "broken.jsonl: cannot read it"),
    (["--model", "{tmp}/no-model"], "cannot load model"),
    (["--resume", "{tmp}/nothing"], "no readable run_config.json there"),
    (["--eval-data", "a=gen"], "--eval-data a=gen"),
]


@pytest.mark.parametrize("argv, needle", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, needle):
    (tmp_path / "rows.txt").write_text("{}\n")
    (tmp_path / "broken.jsonl").write_text('{"nums": [1, 2], "target": 3}\n{"nums": [1,\n')
    os.makedirs(tmp_path / "nothing")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if "--resume" not in argv:  # a resume takes no other flag
        argv = [*SMALL, "--steps", "1", "--out", str(tmp_path / "o"), *argv]
    line = fails(capsys, argv, 2)
    assert needle in line, line
    assert not (tmp_path / "o" / "run_config.json").exists()


@pytest.mark.parametrize("fault, code, said", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), 1,
     "out of GPU memory: lower --micro-batch, --group-size or --max-new-tokens"),
    (MemoryError(), 1, "out of CPU memory: lower --micro-batch"),
    (OSError(errno.ENOSPC, "No space left on device"), 1, "No space left on device"),
    (KeyboardInterrupt(), 130, "interrupted")])
def test_a_fault_while_running_is_one_line_naming_the_checkpoint_kept(tmp_path, capsys, monkeypatch, parity,
                                                                      fault, code, said):
    """Raised in step 3's update (after ckpt-000002): one line with the cause (memory: the flags to lower), the
    checkpoint kept and how to go on; exit 1, or 130 for Ctrl-C. --resume then finishes the run."""
    out = tmp_path / "run"
    update = gmts.policy_update
    calls = []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise fault
        return update(*a, **k)
    monkeypatch.setattr(gmts, "policy_update", failing)
    line = fails(capsys, [*SMALL, "--steps", "4", "--save-every", "1", "--out", out], code)
    assert said in line and line.endswith(f"{out} keeps ckpt-000002: continue with --resume {out}"), line
    monkeypatch.setattr(gmts, "policy_update", update)
    gmts.main(["--resume", str(out)])
    assert [r["step"] for r in metrics(out)] == [0, 1, 2, 3, 4]


def test_ctrl_c_in_a_real_process_is_one_line_and_exit_130(tmp_path):
    """A real SIGINT (the driver sends it after step 2's line): exit 130, one stderr line naming the checkpoint."""
    out = tmp_path / "run"
    r = child(tmp_path, "interrupt", *SMALL, "--steps", "5", "--save-every", "1", "--out", out)
    assert r.returncode == 130, r.stderr
    assert r.stderr.strip().splitlines() == [f"gmts: error: interrupted; {out} keeps ckpt-000001: continue with "
                                             f"--resume {out}"], r.stderr
