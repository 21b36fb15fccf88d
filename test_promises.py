"""Issue 23, "every promise holds": the README's promises about bad input, faults and run folders, one family each.

PROMISES is the table: each case builds its inputs under tmp_path, runs one entry point (gmts.main, gmts_trl.main or
gmts_lab.main) in this process and must end with its exit code, exactly one stderr line and no traceback; for the
run-folder families (1-4) every file that was under tmp_path before is byte for byte the same afterwards. The
families: 1 never replace what is not the run's own, 2 one writer per run folder, 3 resume cannot drift, 4 a run
folder is never a dead end and messages are true, 5 faults give one line, 6 bad data is refused, 7 signals and the
other entry points. Fallbacks that keep training (a damaged checkpoint, the fast rollout path) and the cases that
need a second process (signals, a closed stdout, compare's workers) follow the table.
"""
import contextlib
import hashlib
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import gmts
import gmts_lab
import gmts_trl
from test_gmts import ENV1, HERE, SMALL, finished, parity_reward  # noqa: F401  (finished: a fixture)

assert finished  # the module-scoped fixture test_gmts builds: a 2-step run with ckpt-000001 and ckpt-000002

TRL = ["--model", "tiny", "--short-prompt", "--steps", "1", "--num-generations", "2", "--per-device-batch-size", "2",
       "--grad-accum", "1", "--max-completion-length", "8"]


def snapshot(folder):
    """Every regular file's bytes under folder, by relative path (a FIFO is not opened: it would block)."""
    found = {}
    for d, _, names in os.walk(folder):
        for n in names:
            path = os.path.join(d, n)
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, "rb") as f:
                    found[os.path.relpath(path, folder)] = f.read()
    return found


def _write(path, text):
    with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(text)
    return str(path)


def _user_folder(*names):
    """A folder of the user's with these files (a name ending in / is a folder)."""
    def build(tmp, run):
        os.makedirs(tmp / "mine")
        for n in names:
            if n.endswith("/"):
                os.makedirs(tmp / "mine" / n)
            else:
                _write(tmp / "mine" / n, f"the user's own {n}\n")
        return str(tmp / "mine")
    return build


def _copy_run(edit=None):
    def build(tmp, run):
        out = shutil.copytree(run, tmp / "r")
        if edit:
            edit(out)
        return str(out)
    return build


def _edit_config(fn):
    def edit(out):
        cfg = json.loads((out / "run_config.json").read_text())
        fn(cfg)
        (out / "run_config.json").write_text(json.dumps(cfg))
    return edit


def _data(rows_text):
    return lambda tmp, run: _write(tmp / "d.jsonl", rows_text)


def _rows(*rows):
    return _data("".join(json.dumps(r) + "\n" for r in rows))


def _fifo(tmp, run):
    os.mkfifo(tmp / "fifo")
    return str(tmp / "fifo")


def _model_copy(tmp, run):
    return str(shutil.copytree(run / "ckpt-000002", tmp / "model"))


def _no_tokenizer(tmp, run):
    os.makedirs(tmp / "notok")
    for n in ("config.json", "model.safetensors"):
        shutil.copy(run / "ckpt-000002" / n, tmp / "notok" / n)
    return str(tmp / "notok")


def _kept_data_run(tmp, run):
    """A finished 1-step run on a data file, then the file edited in place."""
    data = _write(tmp / "d.jsonl", "".join(json.dumps({"nums": [n, 2, 3], "target": n + 5}) + "\n" for n in range(8)))
    gmts.main([*SMALL, "--data", data, "--steps", "1", "--out", str(tmp / "dr")])
    _write(tmp / "d.jsonl", "".join(json.dumps({"nums": [n, 2, 3], "target": n + 1}) + "\n" for n in range(8)))
    return str(tmp / "dr")


def _held_by_another(tmp, run):
    """A copy of the run whose folder another live process holds, as a writing run does."""
    out = shutil.copytree(run, tmp / "r")
    code = "import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDWR)\nfcntl.flock(fd, fcntl.LOCK_EX)\n" \
           "print('held', flush=True)\ntime.sleep(120)\n"
    holder = subprocess.Popen([sys.executable, "-c", code, str(out / gmts.RUN_MARK)], stdout=subprocess.PIPE,
                              text=True)
    assert holder.stdout.readline() == "held\n"
    HOLDERS.append(holder)
    return str(out)


def _link(target):
    """A symbolic link at tmp/link to `target` (relative to tmp): a dangling one, or one that points at itself."""
    def build(tmp, run):
        os.symlink(tmp / target, tmp / "link")
        return str(tmp / "link")
    return build


def _too_long_row(tmp, run):
    """Two held-out rows, then a training row whose prompt alone passes the tiny model's 4096 positions."""
    rows = [{"question": "Ann has 3 apples.", "answer": "3"}, {"question": "Bob has 5.", "answer": "5"},
            {"question": "Tom " * 1200 + "has 4.", "answer": "4"}]
    return _write(tmp / "d.jsonl", "".join(json.dumps(r) + "\n" for r in rows))


def _huge_weights_after_update(real):
    def update(model, *a, **k):
        stats = real(model, *a, **k)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1e30)  # finite, but the next distribution is not
        return stats
    return update


def _cpu_alloc_fails(*a, **k):
    raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you "
                       "tried to allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)")


def _template(text):
    """A copy of the run's newest checkpoint whose tokenizer carries the chat template `text`."""
    def build(tmp, run):
        out = shutil.copytree(run / "ckpt-000002", tmp / "tpl")
        cfg = json.loads((out / "tokenizer_config.json").read_text())
        cfg["chat_template"] = text
        (out / "tokenizer_config.json").write_text(json.dumps(cfg))
        if (out / "chat_template.jinja").exists():
            (out / "chat_template.jinja").write_text(text)
        return str(out)
    return build


def _newline_folder(tmp, run):
    """A user's folder whose name holds a newline, with a config.json of the user's."""
    os.makedirs(tmp / "mi\nne")
    _write(tmp / "mi\nne" / "config.json", "{}\n")
    return str(tmp / "mi\nne")


def _folder_holding_a_run(tmp, run):
    os.makedirs(tmp / "outer")
    shutil.copytree(run, tmp / "outer" / "inner")
    return str(tmp / "outer")


def _kl_run_whose_model_changed(tmp, run):
    """A 1-step run with --kl-beta from a model folder, then that folder's weights replaced by other ones."""
    shutil.copytree(run / "ckpt-000001", tmp / "m")
    gmts.main([*SMALL, "--model", str(tmp / "m"), "--kl-beta", "0.5", "--steps", "1", "--save-every", "1", "--out",
               str(tmp / "kl")])
    shutil.copy(run / "ckpt-000002" / "model.safetensors", tmp / "m" / "model.safetensors")
    return str(tmp / "kl")


# issue 44 (files as they are now, --eval-data checked as --data) and issue 42 item 5 (one epoch)
MATH_CSV = "question,answer\n" + "".join(
    f"Ann has {n} apples and gets {n} more. How many?,{2 * n}\n" for n in range(1, 9))
BENCH = "".join(json.dumps({"question": f"Bob has {n} pears. How many?", "answer": str(n)}) + "\n"
                for n in range(1, 4))


def _same_mtime_edit(path, text):
    """Rewrite `path` and give it back its old modification time, as cp -p, rsync -t or tar x do."""
    st = os.stat(path)
    _write(path, text)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _csv_run_edited_with_its_old_mtime(tmp, run):
    """A 1-step math run on a CSV, then the CSV's golds edited and its mtime restored."""
    data = _write(tmp / "d.csv", MATH_CSV)
    gmts.main([*SMALL, "--task", "math", "--data", data, "--steps", "1", "--out", str(tmp / "cr")])
    _same_mtime_edit(data, MATH_CSV.replace(",2\n", ",3\n"))
    return str(tmp / "cr")


def _bench_run(edit):
    """A 1-step math run with --eval-data b=bench.jsonl, then `edit(tmp)`."""
    def build(tmp, run):
        data = _write(tmp / "d.csv", MATH_CSV)
        bench = _write(tmp / "bench.jsonl", BENCH)
        gmts.main([*SMALL, "--task", "math", "--data", data, "--eval-data", f"b={bench}",
                   "--steps", "1", "--out", str(tmp / "br")])
        edit(tmp)
        return str(tmp / "br")
    return build


def _huge_cell_csv(tmp, run):
    return _write(tmp / "d.csv", MATH_CSV + "x" * (gmts.LINE_CAP + 1) + ",4\n")


def _worker_that(fault, when):
    """gmts's own worker script, which runs `fault` (a statement) at each request where `when` (a
    test of its gold and got) holds: the fault happens in the real worker process, in its place."""
    at = "    gold, got = json.loads(line)\n"
    assert at in gmts._VERIFY_WORKER
    return gmts._VERIFY_WORKER.replace(at, f"{at}    if {when}:\n        {fault}\n")


STALL = "import os, signal; os.kill(os.getpid(), signal.SIGSTOP)"  # the worker stops itself


def _boxed_gold(real):
    """math_reward on `\\boxed{gold}`, whatever the tiny model wrote: each reaches the worker."""
    return lambda completion, answer, *a, **k: real(f"\\boxed{{{answer}}}", answer, *a, **k)


HOLDERS = []
PLACES = {
    "config_json": _user_folder("config.json"),
    "metrics_png": _user_folder("metrics.png", "notes.txt"),
    "final_tmp": _user_folder("final.tmp/"),
    "readme": _user_folder("README.md"),
    "model": _model_copy,
    "run": _copy_run(),
    "held": _held_by_another,
    "no_select": _copy_run(_edit_config(lambda c: c.pop("select"))),
    "extra_key": _copy_run(_edit_config(lambda c: c.update(selct="all"))),
    "no_ckpt": _copy_run(lambda out: [shutil.rmtree(c) for c in gmts.checkpoints(str(out))]),
    "data_run": _kept_data_run,
    "file": lambda tmp, run: _write(tmp / "file", "x\n"),
    "notok": _no_tokenizer,
    "deep": _data('{"nums": ' + "[" * 100_000 + "]" * 100_000 + ', "target": 1}\n'),
    "surrogate": _data('{"question": "How many \\ud800 apples?", "answer": "3"}\n'),
    "fifo": _fifo,
    "cd_negative": _rows({"nums": [-3, 5], "target": 2}),
    "cd_empty": _rows({"nums": [], "target": 0}),
    "cd_huge": _rows({"nums": [10 ** 150, 10 ** 150], "target": 2 * 10 ** 150}),
    "math_empty": _rows({"question": "  ", "answer": "3"}),
    "math_nan": _data('{"question": "How many?", "answer": NaN}\n'),
    "math_problem": _rows({"problem": "What is 2+2?", "answer": "4"},
                          {"problem": "What is 3+3?", "answer": "6"}),
    "math_no_answer": _rows({"problem": "What is 2+2?", "level": "Level 1", "type": "Algebra"}),
    "math_two_bad": _rows({"question": "a"}, {"question": "What is 2+2?", "answer": "4"},
                          {"question": "b"}),
    "logic_digit": _rows({"names": ["Al1ce", "Bob"], "statements": ["Al1ce: Bob is a knave."],
                          "solution": {"Al1ce": True, "Bob": False}}),
    "logic_other": _rows({"names": ["Alice", "Bob"], "statements": ["Alice: Bob is a knave."],
                          "solution": {"Alice": True, "Carol": False}}),
    "logic_case": _rows({"names": ["Alice", "alice"], "statements": ["Alice: alice is a knave."],
                         "solution": {"Alice": True, "alice": False}}),
    "digits": _data('{"nums": [1, 2], "target": ' + "9" * 5000 + '}\n'),
    "too_long": _too_long_row,
    "dangling": _link("nowhere"),
    "loop": _link("link"),
    "eval0": _copy_run(_edit_config(lambda c: c.update(eval_size=0))),
    "leftovers": _user_folder("ckpt-000001.old/", "ckpt-000001.old/precious.bin", "final.tmp", "metrics.jsonl.tmp"),
    "config_tmp": _user_folder("run_config.json.tmp"),
    "raising_template": _template("{{ raise_exception('System role not supported') }}"),
    "broken_template": _template("{% for m in messages %}{{ m['content'] }"),
    "newline": _newline_folder,
    "holds_run": _folder_holding_a_run,
    "kl_run": _kl_run_whose_model_changed,
    "csv_run": _csv_run_edited_with_its_old_mtime,
    "bench_run": _bench_run(
        lambda tmp: _same_mtime_edit(tmp / "bench.jsonl", BENCH.replace('"1"', '"7"'))),
    "bench": lambda tmp, run: _write(tmp / "bench.jsonl", BENCH),
    "math_csv": lambda tmp, run: _write(tmp / "d.csv", MATH_CSV),
    "huge_cell": _huge_cell_csv,
    "latex_jsonl": _rows({"problem": "Simplify sqrt 8 / 2.", "answer": "\\sqrt{2}"}),
    "latex_rows": _rows({"problem": "Halve one.", "answer": "\\frac{1}{2}"},
                        {"problem": "Root of two?", "answer": "\\sqrt{2}"},
                        {"problem": "Solve $x > 728$.", "answer": "(729,\\infty)"},
                        {"problem": "Solve $x - 1 > 727$.", "answer": "(729,\\infty)"}),
}


def _interrupt_at(name):
    """Raise KeyboardInterrupt at the first call of gmts.<name> (patched by the case)."""
    def boom(*a, **k):
        raise KeyboardInterrupt
    return {name: boom}


def _interrupt_at_step(step, real):
    """gmts.log_metrics that raises KeyboardInterrupt at `step`'s line, after the checkpoints before it."""
    def log(path, rec):
        if rec["step"] == step:
            raise KeyboardInterrupt
        return real(path, rec)
    return log


def _raise(error):
    """A stand-in that raises `error` (a class or an instance) wherever the real function is called."""
    def boom(*a, **k):
        raise error
    return boom


def _on_call(n, real, error):
    """`real` for the first n - 1 calls, then `error` at the n-th (and `real` after it)."""
    calls = []

    def fn(*a, **k):
        calls.append(1)
        if len(calls) == n:
            raise error
        return real(*a, **k)
    return fn


def _when(test, real, error):
    """`real`, except that a call whose keyword arguments pass `test` raises `error`."""
    def fn(*a, **k):
        if test(k):
            raise error
        return real(*a, **k)
    return fn


def _wandb_without_a_login(*a, **k):
    from wandb.errors import UsageError  # what wandb.init raised here with no API key and no terminal (0.31)
    raise UsageError("No API key configured. Use `wandb login` to log in.")


OOM = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
CPU_ALLOC = RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you "
                         "tried to allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)")
NO_POOL = {"gmts_lab:multiprocessing.get_context": _raise(KeyboardInterrupt)}  # compare stops where its workers start


def _disk_full_safetensors():
    from safetensors import SafetensorError

    def full(*a, **k):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No "
                              "space left on device\" })")
    return full


def _disk_full_torch_save(obj, path, *a, **k):
    raise RuntimeError("[enforce fail at inline_container.cc:603] . PytorchStreamWriter failed writing file "
                       "data/0: file write failed")


def _nan_after_update(real):
    def update(model, *a, **k):
        stats = real(model, *a, **k)
        with torch.no_grad():
            next(model.parameters())[0, 0] = float("nan")
        return stats
    return update


G, T, L = "gmts", "trl", "lab"
MATH_ON_CSV = ["--task", "math", "--data", "{math_csv}", "--steps", "1"]
ENOSPC = OSError(28, "No space left on device")
# (id, family, entry point, argv, exit code, needle, patches {gmts attribute or "module:attribute": value})
PROMISES = [
    ("user config.json in --out", 1, G, ["--out", "{config_json}"], 2, "no gmts run of this program wrote", {}),
    ("user metrics.png in --out", 1, G, ["--out", "{metrics_png}"], 2, "metrics.png", {}),
    ("user final.tmp/ in --out", 1, G, ["--out", "{final_tmp}"], 2, "final.tmp", {}),
    ("--out is the --model folder", 1, G, ["--model", "{model}", "--out", "{model}"], 2, "--model folder", {}),
    ("--out in the committed warm/", 1, G, ["--out", os.path.join(os.path.dirname(gmts.WARM_CPU), "new")], 2,
     "committed warm", {}),
    ("trl, user README.md in --out", 1, T, ["--out", "{readme}"], 2, "README.md", {}),
    ("lab warm --out a training run", 1, L, ["warm", "--out", "{run}"], 2, "not a warm one",
     {"gmts_lab:sft_warmup": lambda *a, **k: None}),
    ("lab warm --out an existing file", 1, L, ["warm", "--out", "{file}"], 2, "existing file",
     {"gmts_lab:sft_warmup": lambda *a, **k: None}),
    ("resume while another process writes", 2, G, ["--resume", "{held}"], 2, "another process", {}),
    ("compare --methods gmts,gmts", 2, L, ["compare", "--preset", "smoke", "--methods", "gmts,gmts", "--seeds", "1",
                                           "--out", "{tmp}/cmp"], 2, "twice", {}),
    ("resume with another --select", 3, G, ["--resume", "{run}", "--select", "entropy"], 2, "--allow-change", {}),
    ("resume with another --lr", 3, G, ["--resume", "{run}", "--lr", "0.5"], 2, "--allow-change", {}),
    ("resume with another --seed", 3, G, ["--resume", "{run}", "--seed", "7"], 2, "--allow-change", {}),
    ("resume, run_config lacks a key", 3, G, ["--resume", "{no_select}"], 2, "lacks select", {}),
    ("resume, run_config has an unknown key", 3, G, ["--resume", "{extra_key}"], 2, "unknown keys selct", {}),
    ("resume, the data file changed", 3, G, ["--resume", "{data_run}", "--steps", "2"], 2, "not the file", {}),
    ("Ctrl-C at the step-0 eval says no checkpoint", 4, G, ["--out", "{tmp}/o"], 130, "holds no checkpoint yet",
     _interrupt_at("evaluate")),
    ("Ctrl-C after a checkpoint names it", 4, G, ["--out", "{tmp}/o", "--steps", "3", "--save-every", "1"], 130,
     "keeps ckpt-000001: continue with --resume", {"log_metrics": _interrupt_at_step(2, gmts.log_metrics)}),
    ("full disk in safetensors", 5, G, ["--out", "{tmp}/o"], 1, "No space left on device",
     {"transformers.modeling_utils:safe_save_file": _disk_full_safetensors()}),
    ("full disk in torch.save", 5, G, ["--out", "{tmp}/o"], 1, "file write failed",
     {"torch:save": _disk_full_torch_save}),
    ("model folder without tokenizer files", 5, G, ["--model", "{notok}"], 1, "no tokenizer files", {}),
    ("trl, model folder without tokenizer files", 5, T, ["--model", "{notok}"], 1, "no tokenizer files", {}),
    ("--lr 1e10", 5, G, ["--lr", "1e10"], 2, "--lr must be in (0, 1]", {}),
    ("non-finite weights after a step", 5, G, ["--out", "{tmp}/o", "--steps", "2"], 1, "non-finite weights",
     {"policy_update": _nan_after_update(gmts.policy_update)}),
    ("data nested 100,000 deep", 6, G, ["--data", "{deep}"], 2, "line 1: JSON nested too deep", {}),
    ("data lone surrogate in a question", 6, G, ["--task", "math", "--data", "{surrogate}"], 2,
     "line 1: holds a lone surrogate", {}),
    ("data a FIFO", 6, G, ["--data", "{fifo}"], 2, "not a regular file", {}),
    ("data /dev/zero", 6, G, ["--data", "/dev/zero"], 2, "not a regular file", {}),
    ("countdown negative nums", 6, G, ["--data", "{cd_negative}"], 2, "line 1: \"nums\" must be non-empty", {}),
    ("countdown empty nums", 6, G, ["--data", "{cd_empty}"], 2, "line 1: \"nums\" must be non-empty", {}),
    ("countdown nums too long to answer", 6, G, ["--data", "{cd_huge}"], 2, "line 1: \"nums\" are too long", {}),
    ("math empty question", 6, G, ["--task", "math", "--data", "{math_empty}"], 2, "line 1: \"question\" is empty",
     {}),
    ("logic name with a digit", 6, G, ["--task", "logic", "--data", "{logic_digit}"], 2, "line 1: name 'Al1ce'", {}),
    ("logic solution names other people", 6, G, ["--task", "logic", "--data", "{logic_other}"], 2,
     "line 1: \"solution\" must name exactly", {}),
    ("logic names clash in case", 6, G, ["--task", "logic", "--data", "{logic_case}"], 2, "ignores case", {}),
    ("trl, Ctrl-C in trainer.train", 7, T, ["--out", "{tmp}/t"], 130, "interrupted",
     {"gmts_trl:GMTSTrainer.train": _interrupt_at("x")["x"]}),
    ("analyze --batches 0", 7, L, ["analyze", "--preset", "smoke", "--batches", "0", "--out", "{tmp}/a"], 2,
     "--batches must be >= 1", {}),
    ("analyze a model that earns nothing", 7, L, ["analyze", "--preset", "smoke", "--batches", "1", "--out",
                                                  "{tmp}/a"], 1, "nothing to analyse", {}),
    ("--seed 2**63 - 1", 7, G, ["--seed", str(2 ** 63 - 1)], 2, "--seed must be in [0, 2**32)", {}),
    # issue 29: the second probe's cases, each failing on 09cce72
    ("--out a checkpoint folder of a run", 1, G, ["--out", "{run}/ckpt-000002"], 2, "lies inside", {}),
    ("--out final.tmp inside a run", 1, G, ["--out", "{run}/final.tmp"], 2, "lies inside", {}),
    ("--out deeper inside a run", 1, G, ["--out", "{run}/mine/deeper"], 2, "lies inside", {}),
    ("lab analyze --out inside a run", 1, L, ["analyze", "--preset", "smoke", "--out", "{run}/a"], 2, "lies inside",
     {}),
    ("trl --out inside a run", 1, T, ["--out", "{run}/t"], 2, "lies inside", {}),
    ("--out a dangling symlink", 1, G, ["--out", "{dangling}"], 2, "symbolic link to nothing", {}),
    ("--out a looping symlink", 1, G, ["--out", "{loop}"], 2, "symbolic link to nothing", {}),
    ("resume with a preset", 3, G, ["--resume", "{run}", "--preset", "cpu"], 2, "--preset cannot apply", {}),
    ("--temperature 1e-320", 5, G, ["--temperature", "1e-320"], 2, "--temperature must be finite and >= 1e-4", {}),
    ("finite but huge weights after a step", 5, G, ["--out", "{tmp}/o", "--steps", "2"], 1,
     "non-finite weights or logits", {"policy_update": _huge_weights_after_update(gmts.policy_update)}),
    ("a CPU allocation fails", 5, G, ["--model", "tiny", "--tiny-hidden", "1000000"], 1, "out of CPU memory", {}),
    ("a CPU allocation fails in a rollout", 5, G, ["--out", "{tmp}/o"], 1, "out of CPU memory",
     {"rollout": _cpu_alloc_fails}),
    ("data a 5000-digit integer", 6, G, ["--data", "{digits}"], 2, "d.jsonl line 1: ", {}),
    ("trl, data a 5000-digit integer", 6, T, ["--data", "{digits}"], 2, "d.jsonl line 1: ", {}),
    ("data a training row too long for the positions", 6, G, ["--task", "math", "--data", "{too_long}"], 2,
     "d.jsonl line 3: its", {}),
    ("lab report --png a folder", 7, L, ["report", "a={tmp}", "--png", "{tmp}"], 2, "must name a .png file", {}),
    ("lab decoy on a run with eval_size 0", 7, L, ["decoy", "--model", "{eval0}"], 2,
     "run_config.json: --eval-size must be >= 1", {}),
    # issue 38: memory at every site (one line, exit 1, the checkpoint named, no --overwrite), each failing on 47c0a22
    ("OOM while the starting model loads", 5, G, ["--model", "{model}"], 1, "out of GPU memory",
     {"transformers:AutoModelForCausalLM.from_pretrained": _raise(OOM)}),
    ("OOM moving a checkpoint to the device on --resume", 4, G, ["--resume", "{run}"], 1,
     "out of GPU memory: lower --micro-batch, --group-size or --max-new-tokens; ",
     {"transformers:Qwen2ForCausalLM.to": _raise(OOM)}),
    ("MemoryError reading state.pt on --resume", 4, G, ["--resume", "{run}"], 1, "keeps ckpt-000002: continue with",
     {"torch:load": _raise(MemoryError)}),
    ("a one-off OOM on the newest checkpoint", 4, G, ["--resume", "{run}"], 1, "keeps ckpt-000002",
     {"torch:load": _on_call(1, torch.load, OOM)}),
    ("OOM in a training rollout", 5, G, ["--steps", "1"], 1, "keeps ckpt-000000: continue with --resume",
     {"rollout": _when(lambda k: k.get("sampler_logp"), gmts.rollout, OOM)}),
    ("CPU memory on the fast rollout path", 5, G, ["--steps", "1", "--fast-generate"], 1, "out of CPU memory",
     {"rollout": _when(lambda k: k.get("fast"), gmts.rollout, CPU_ALLOC)}),
    ("OOM in the update", 5, G, ["--steps", "1"], 1, "keeps ckpt-000000", {"policy_update": _raise(OOM)}),
    ("OOM in the evaluation after step 1", 5, G, ["--steps", "1"], 1, "keeps ckpt-000000",
     {"evaluate": _on_call(2, gmts.evaluate, OOM)}),
    ("OOM in torch.save of the first checkpoint", 5, G, [], 1, "holds no checkpoint yet", {"torch:save": _raise(OOM)}),
    ("MemoryError in save_pretrained", 5, G, [], 1, "out of CPU memory",
     {"transformers.modeling_utils:safe_save_file": _raise(MemoryError)}),
    ("lab analyze, OOM while its model loads", 5, L, ["analyze", "--preset", "smoke", "--out", "{tmp}/a"], 1,
     "out of GPU memory", {"transformers:AutoModelForCausalLM.from_pretrained": _raise(OOM)}),
    ("trl, OOM while the weights load", 5, T, ["--model", "{model}"], 1,
     "out of GPU memory: lower --per-device-batch-size", {"trl.trainer.utils:create_model_from_path": _raise(OOM)}),
    ("trl, MemoryError in training", 5, T, [], 1, "out of CPU memory", {"gmts_trl:GMTSTrainer.train":
                                                                         _raise(MemoryError)}),
    # issue 38: empty and many-line messages, and who is blamed
    ("empty OSError from the tokenizer's from_pretrained", 5, G, ["--model", "{model}"], 1, "cannot load model",
     {"transformers:AutoTokenizer.from_pretrained": _raise(OSError())}),
    ("--data hf, empty OSError from load_dataset", 6, G, ["--data", "hf"], 2, "could not load",
     {"datasets:load_dataset": _raise(OSError())}),
    ("a damaged model folder is not the hub's fault", 5, G, ["--model", "{notok}"], 1,
     "its files are missing or damaged", {}),
    ("an empty ValueError", 5, G, [], 2, "error: ValueError", {"read_data": _raise(ValueError())}),
    ("a ValueError over two lines", 5, G, [], 2, "first\\nsecond", {"read_data": _raise(ValueError("first\nsecond"))}),
    ("a newline in --out's name", 1, G, ["--out", "{newline}"], 2, "\\nne holds config.json", {}),
    # issue 38: the fresh probe's other roots
    ("a chat template that refuses the system role", 5, G, ["--model", "{raising_template}"], 2,
     "chat template fails on this run's prompts (TemplateError: System role not supported)", {}),
    ("a chat template with a syntax error", 5, G, ["--model", "{broken_template}"], 2, "chat template fails", {}),
    ("trl, a chat template that refuses the system role", 5, T, ["--model", "{raising_template}"], 2,
     "System role not supported", {}),
    ("a stop signal while the final plot is drawn", 4, G, ["--steps", "1"], 130,
     "keeps ckpt-000001: continue with --resume", {"plot_metrics": _raise(KeyboardInterrupt)}),
    ("a stop signal while a resumed run saves its final model", 7, G, ["--resume", "{run}", "--steps", "3"], 130,
     "keeps ckpt-000003", {"save_final": _raise(KeyboardInterrupt)}),
    ("lab analyze keeps a user's files named like leftovers", 1, L, ["analyze", "--preset", "smoke", "--batches", "1",
                                                                     "--out", "{leftovers}"], 1, "nothing to analyse",
     {}),
    ("trl keeps a user's files named like leftovers", 1, T, ["--out", "{leftovers}"], 130, "interrupted",
     {"gmts_trl:GMTSTrainer.train": _raise(KeyboardInterrupt)}),
    ("compare keeps a user's files named like leftovers", 1, L, ["compare", "--preset", "smoke", "--methods", "all",
                                                                 "--seeds", "1", "--out", "{leftovers}"], 130,
     "interrupted", NO_POOL),
    ("gmts refuses a user's run_config.json.tmp", 1, G, ["--out", "{config_tmp}"], 2, "holds run_config.json.tmp",
     {}),
    ("a new run into a folder that holds a run", 1, G, ["--out", "{holds_run}", "--steps", "1"], 2,
     "which holds a gmts output", {}),
    ("lab analyze into a folder that holds a run", 1, L, ["analyze", "--preset", "smoke", "--out", "{holds_run}"], 2,
     "which holds a gmts output", {}),
    ("resume with --kl-beta after the --model folder changed", 3, G, ["--resume", "{kl_run}", "--steps", "2"], 2,
     "is not the KL reference the run started from", {}),
    ("--report-to wandb without a login", 5, G, ["--report-to", "wandb", "--steps", "1"], 2,
     "--report-to wandb cannot start: No API key configured", {"wandb:init": _wandb_without_a_login}),
    ("compare, seeds past 2**32", 7, L, ["compare", "--preset", "smoke", "--seed", str(2 ** 32 - 1), "--seeds", "2",
                                         "--methods", "all", "--out", "{tmp}/c"], 2, "past 2**32 - 1", NO_POOL),
    ("compare --seeds 10**12", 7, L, ["compare", "--preset", "smoke", "--seeds", str(10 ** 12), "--methods", "all",
                                      "--out", "{tmp}/c"], 2, "--seeds must be in [1, 1000]", NO_POOL),
    ("--resume '' (an unset shell variable)", 4, G, ["--resume", "", *SMALL, "--steps", "1", "--out", "{tmp}/o"], 2,
     "--resume names no folder", {}),
    ("--threads 10**20", 5, G, ["--threads", str(10 ** 20)], 2, "--threads must be in [0, 1024]", {}),
    # issue 44 item 9, issue 42 items 4 and 6: bounds stated, prompts capped before step 0
    ("--eval-samples 10**9", 5, G, ["--eval-samples", str(10 ** 9)], 2,
     "--eval-samples must be in [0, 1024]", {}),
    ("--adam-eps 0", 5, G, ["--adam-eps", "0"], 2, "--adam-eps must be finite and > 0", {}),
    ("--max-prompt-tokens below the prompts", 6, G, ["--max-prompt-tokens", "5"], 2,
     "2 prompts have more tokens than --max-prompt-tokens 5: held-out row 0 of --data easy (", {}),
    ("--out in /proc (root may write anywhere else)", 1, G, ["--out", "/proc/gmts-x"], 2,
     "is not a folder that can be written", {}),
    ("compare --rhos", 7, L, ["compare", "--preset", "smoke", "--rhos", "0.1", "--out", "{tmp}/c"], 2,
     "--rhos is analyze's flag", NO_POOL),
    ("analyze --arms all (the one-rho table scores ANALYZED)", 7, L, ["analyze", "--preset", "smoke", "--arms", "all",
                                                                       "--out", "{tmp}/a"], 2,
     "is not scored by the one-rho table", {}),
    ("analyze --arms , (no arm)", 7, L, ["analyze", "--preset", "smoke", "--arms", ",", "--rhos", "0.1",
                                          "--out", "{tmp}/a"], 2, "is not METHOD or METHOD@SCOPE", {}),
    ("report a=X a=Y", 7, L, ["report", "a={tmp}", "a={tmp}", "--png", "{tmp}/r.png"], 2, "a title of its own", {}),
    # issue 44: files as they are now, --eval-data checked as --data is, errors by cause; issue
    # 42: --data-order; each failing on e3741a4
    ("resume, a CSV edited and given back its mtime", 3, G,
     ["--resume", "{csv_run}", "--steps", "2"], 2, "d.csv is not the file the run started", {}),
    ("resume, a benchmark file edited", 3, G, ["--resume", "{bench_run}", "--steps", "2"], 2,
     "--eval-data b=", {}),
    ("--eval-data with a name given twice", 6, G,
     [*MATH_ON_CSV, "--eval-data", "b={bench},b={math_csv}"], 2, "b is named twice", {}),
    ("--eval-data NAME=gen", 6, G, ["--eval-data", "g=gen", "--steps", "1"], 2,
     "a benchmark is a data file or set", {}),
    ("a CSV cell over the cap", 6, G, ["--task", "math", "--data", "{huge_cell}", "--steps", "1"],
     2, "d.csv row 9: a cell is longer than 1048576 characters", {}),
    ("MemoryError inside the CSV reader", 5, G, MATH_ON_CSV, 1, "out of CPU memory",
     {"datasets.packaged_modules.csv.csv:Csv._generate_tables": _raise(MemoryError)}),
    ("a full disk under datasets' writer", 5, G, MATH_ON_CSV, 1, "No space left on device",
     {"datasets.arrow_writer:ArrowWriter.finalize": _raise(ENOSPC)}),
    ("a read-only HF_DATASETS_CACHE", 5, G, MATH_ON_CSV, 1,
     "cannot write the datasets cache folder /sys/gmts-cache",
     {"datasets.config:HF_DATASETS_CACHE": "/sys/gmts-cache"}),
    ("a grader's OSError while a JSONL loads is not the file's", 5, G,
     ["--task", "math", "--data", "{latex_jsonl}", "--steps", "1"], 1, "Broken pipe",
     {"latex_equal": _raise(BrokenPipeError(32, "Broken pipe"))}),
    ("--data-order epoch on generated data", 6, G, ["--data-order", "epoch", "--steps", "1"], 2,
     "--data easy draws fresh problems", {}),
    ("lab decoy --eval-data", 7, L, ["decoy", "--model", "{run}", "--eval-data", "b={bench}"], 2,
     "not --eval-data's sets", {}),
    # issues 42 and 44: math rows (finite golds, the layout's columns, every bad row named),
    # each failing on e3741a4
    ("math a NaN gold", 6, G, ["--task", "math", "--data", "{math_nan}"], 2,
     'line 1: "answer" must be a finite number', {}),
    ("trl, math a NaN gold", 6, T, ["--task", "math", "--data", "{math_nan}"], 2,
     'line 1: "answer" must be a finite number', {}),
    ("--data-columns names a column the rows lack", 6, G,
     ["--task", "math", "--data", "{math_problem}", "--data-columns", "problme,answer"], 2,
     'the row has no column "problme"', {}),
    ("math a solution-only row without an answer", 6, G,
     ["--task", "math", "--data", "{math_no_answer}"], 2,
     'line 1: missing key "answer" (looked for the answer in: answer, Answer, final_answer', {}),
    ("math every bad row named", 6, G, ["--task", "math", "--data", "{math_two_bad}"], 2,
     'd.jsonl line 3: missing key "answer"', {}),
    # issue 44: the grader tells the truth (a worker's fault: exit 1, its own words), each failing
    # on e3741a4
    ("a stalled grading worker at load is not bad data", 5, G,
     ["--task", "math", "--data", "{latex_rows}"], 1,
     "the math-verify worker gave no verdict on the gold '(729,\\\\infty)', twice",
     {"VERIFY_TIMEOUT_S": 1.0, "_VERIFY_WORKER": _worker_that(STALL, '"729" in gold'),
      "_VERIFIER": gmts._verifier_pool(1)}),
    ("a grading worker that cannot start", 5, G, ["--task", "math", "--data", "{latex_rows}"], 1,
     "the math-verify worker did not start: [Errno 2] No such file or directory: '/nowhere/python'",
     {"sys:executable": "/nowhere/python", "_VERIFIER": gmts._verifier_pool(1)}),
    ("answers without a verdict past the share stop the run", 5, G,
     ["--task", "math", "--data", "{latex_rows}", "--steps", "2", "--prompts-per-step", "1",
      "--group-size", "2", "--no-filter-groups"], 1,
     "step 1: 2 of 2 answers got no verdict from the math-verify worker (the last: no verdict",
     {"VERIFY_TIMEOUT_S": 1.0, "_VERIFIER": gmts._verifier_pool(1),
      "math_reward": _boxed_gold(gmts.math_reward),
      "_VERIFY_WORKER": _worker_that(STALL, '"729" in gold and got is not None')}),
]
MAINS = {G: (lambda argv: gmts.main(argv), "gmts: error: "), T: (lambda argv: gmts_trl.main(argv), "gmts_trl: error: "),
         L: (lambda argv: gmts_lab.main(argv), "gmts: error: ")}


def _patch(monkeypatch, patches):
    for where, value in patches.items():
        module, _, attr = where.rpartition(":")
        obj = importlib.import_module(module or "gmts")
        for part in attr.split(".")[:-1]:
            obj = getattr(obj, part)
        monkeypatch.setattr(obj, attr.split(".")[-1], value)


@pytest.mark.parametrize("family, entry, argv, code, needle, patches",
                         [pytest.param(*c[1:], id=f"{c[1]}-{c[0]}") for c in PROMISES])
def test_promise(tmp_path, finished, capsys, monkeypatch, family, entry, argv, code, needle, patches):
    built = {"tmp": str(tmp_path)}

    def place(m):
        if m[1] not in built:
            built[m[1]] = PLACES[m[1]](tmp_path, finished)
        return built[m[1]]
    argv = [re.sub(r"\{(\w+)\}", place, a) for a in argv]
    if entry == G and "--resume" not in argv:
        argv = [*SMALL, "--out", str(tmp_path / "o"), *argv]  # the case's own flags come last and win
    if entry == T:
        argv = [*TRL, "--out", str(tmp_path / "t"), *argv]
    before = snapshot(tmp_path)
    warm = snapshot(os.path.dirname(gmts.WARM_CPU))
    _patch(monkeypatch, patches)
    run, prefix = MAINS[entry]
    try:
        with pytest.raises(SystemExit) as e:
            run(argv)
    finally:
        for h in HOLDERS:
            h.kill()
            h.wait()
        HOLDERS.clear()
    err = capsys.readouterr().err
    assert e.value.code == code and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix) and needle in lines[0], err
    assert "memory" not in lines[0] or "--overwrite" not in lines[0], err  # memory is never the files' fault
    assert snapshot(os.path.dirname(gmts.WARM_CPU)) == warm  # the committed warm starts are never touched
    after = snapshot(tmp_path)
    if family <= 4:  # every file that was there is byte for byte the same
        assert {k: after.get(k) for k in before} == before
    if family == 5:  # no half-written checkpoint or final model is left behind
        assert not [k for k in after if ".tmp" in k]
        assert not [k for k in after if "ckpt-000001" in k and k not in before]  # nor one of the failed step
    if family == 6:  # bad data is refused before step 0: nothing was saved
        assert not [k for k in after if "ckpt-" in k and k not in before]


# ---- fallbacks that keep training ---------------------------------------------------------------------------------

def _break_template(ck):
    cfg = json.loads((ck / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }"  # does not compile
    (ck / "tokenizer_config.json").write_text(json.dumps(cfg))
    if (ck / "chat_template.jinja").exists():
        (ck / "chat_template.jinja").write_text(cfg["chat_template"])


def _nan_weights(ck):
    from safetensors.torch import load_file, save_file
    w = load_file(str(ck / "model.safetensors"))
    first = sorted(w)[0]
    w[first][0] = float("nan")
    save_file(w, str(ck / "model.safetensors"), metadata={"format": "pt"})


def _drop_template(ck):
    cfg = json.loads((ck / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (ck / "tokenizer_config.json").write_text(json.dumps(cfg))
    if (ck / "chat_template.jinja").exists():
        os.remove(ck / "chat_template.jinja")


@pytest.mark.parametrize("damage", [_nan_weights, _break_template, _drop_template],
                         ids=["5-NaN weights", "5-template does not compile", "3-template lost (another format)"])
def test_a_checkpoint_that_cannot_continue_the_run_falls_back(tmp_path, finished, capsys, monkeypatch, damage):
    """The newest checkpoint with NaN weights, a chat template that does not compile, or none at all (another prompt
    format than the run's): --resume says so in one line, reruns step 2 from ckpt-000001 and ends with the
    uninterrupted run's weights."""
    from safetensors.torch import load_file
    monkeypatch.setitem(gmts.TASKS["countdown"], "reward", parity_reward)
    out = shutil.copytree(finished, tmp_path / "r")
    damage(out / "ckpt-000002")
    gmts.main(["--resume", str(out)])
    said = [ln for ln in capsys.readouterr().out.splitlines() if "ckpt-000002 does not load" in ln]
    assert len(said) == 1, said
    new, old = load_file(str(out / "model.safetensors")), load_file(str(finished / "model.safetensors"))
    assert all(torch.equal(new[k], old[k]) for k in old)


def test_the_fast_rollout_path_falls_back_once_and_training_goes_on(tmp_path, capsys, monkeypatch):
    """--fast-generate on a machine where the static cache fails: one line, then the plain path for every step."""
    real, calls = gmts.rollout, []

    def rollout(*a, fast=False, **k):
        calls.append(fast)
        if fast:
            raise RuntimeError("torch._dynamo hit a recompile limit\nsecond line of the error")
        return real(*a, **k)
    monkeypatch.setattr(gmts, "rollout", rollout)
    gmts.main([*SMALL, "--steps", "3", "--fast-generate", "--out", str(tmp_path / "o")])
    said = [ln for ln in capsys.readouterr().out.splitlines() if "fast generation failed" in ln]
    assert len(said) == 1 and "plain path" in said[0]
    assert [r["step"] for r in gmts.read_metrics(str(tmp_path / "o"))] == [0, 1, 2, 3]
    assert calls.count(True) == 1


# ---- valid data accepted; a folder without a checkpoint starts afresh --------------------------------------------

def test_a_raw_u2028_inside_a_json_string_is_one_row(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(('{"question": "Tom has 3 apples.\u2028How many?", "answer": "3"}\n'
                      '{"question": "Ann has 5.", "answer": "5"}\n').encode())
    rows = gmts.load_rows("math", str(path))
    assert [r["answer"] for r in rows] == ["3", "5"] and "\u2028" in rows[0]["question"]


@pytest.mark.parametrize("how", ["rerun", "resume"])
def test_a_folder_without_a_checkpoint_starts_afresh(tmp_path, finished, capsys, monkeypatch, how):
    """A run killed before its first checkpoint leaves run_config.json and an empty metrics.jsonl: a rerun or a
    --resume starts it afresh (no --overwrite needed), step 0 logged once."""
    monkeypatch.setitem(gmts.TASKS["countdown"], "reward", parity_reward)
    out = shutil.copytree(finished, tmp_path / "r")
    for c in gmts.checkpoints(str(out)):
        shutil.rmtree(c)
    (out / "metrics.jsonl").write_text("")
    cfg = json.loads((out / "run_config.json").read_text())
    argv = ["--resume", str(out)]
    if how == "rerun":
        argv = [*SMALL, "--steps", "2", "--save-every", "1", "--lr", str(cfg["lr"]), "--warmup-steps", "0", "--out",
                str(out)]
    gmts.main(argv)
    assert [r["step"] for r in gmts.read_metrics(str(out))] == [0, 1, 2]
    assert capsys.readouterr().err == ""


def test_resume_reads_the_data_file_by_its_absolute_path(tmp_path, monkeypatch):
    """--data given relative to the first cwd is stored absolute: a resume from elsewhere reads the same file."""
    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "d.jsonl", "".join(json.dumps({"nums": [n, 2, 3], "target": n + 5}) + "\n" for n in range(8)))
    gmts.main([*SMALL, "--data", "d.jsonl", "--steps", "1", "--out", "run"])
    assert json.loads((tmp_path / "run" / "run_config.json").read_text())["data"] == str(tmp_path / "d.jsonl")
    os.makedirs(tmp_path / "elsewhere")
    monkeypatch.chdir(tmp_path / "elsewhere")
    _write(tmp_path / "elsewhere" / "d.jsonl", json.dumps({"nums": [1, 1], "target": 2}) + "\n")
    gmts.main(["--resume", str(tmp_path / "run"), "--steps", "2"])
    assert [r["step"] for r in gmts.read_metrics(str(tmp_path / "run"))] == [0, 1, 2]


# ---- a second process: signals, a closed stdout, compare's workers -----------------------------------------------

SMOKE = [sys.executable, os.path.join(HERE, "gmts.py"), "--preset", "smoke", "--steps", "500", "--eval-every", "0"]


def _start(argv, tmp_path):
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=ENV1)


def _wait_for(proc, text, timeout=240):
    t0 = time.time()
    for line in proc.stdout:
        if text in line or time.time() - t0 > timeout:
            return line
    return ""


@pytest.mark.parametrize("signals", [(signal.SIGTERM,), (signal.SIGHUP,), (signal.SIGINT, signal.SIGINT)],
                         ids=["7-SIGTERM", "7-SIGHUP", "7-SIGINT twice in 1 ms"])
def test_a_stop_signal_is_one_line_and_exit_130(tmp_path, signals):
    proc = _start([*SMOKE, "--out", str(tmp_path / "o")], tmp_path)
    assert "step 1 " in _wait_for(proc, "step 1 ")
    for sig in signals:
        proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.count("\n") == 1 and "interrupted; " in err and "keeps ckpt-000000" in err, err


def test_a_closed_stdout_stops_printing_not_training(tmp_path):
    """python gmts.py ... | head -1: the run goes on to its end and exits 0."""
    cmd = " ".join([*SMOKE[:-4], "--steps", "3", "--out", str(tmp_path / "o")]) + " | head -1"
    r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, env=ENV1, timeout=300)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.startswith("config ") and r.stdout.count("\n") == 1
    assert [x["step"] for x in gmts.read_metrics(str(tmp_path / "o"))] == [0, 1, 2, 3]
    assert (tmp_path / "o" / "model.safetensors").exists()


def test_compare_workers_stop_with_the_parent(tmp_path):
    """SIGINT to compare's parent alone: one line, exit 130, and no worker goes on training."""
    argv = [sys.executable, os.path.join(HERE, "gmts_lab.py"), "compare", "--preset", "smoke", "--steps", "500",
            "--eval-every", "0", "--methods", "all,gmts", "--seeds", "1", "--workers", "2",
            "--out", str(tmp_path / "c")]
    proc = _start(argv, tmp_path)
    t0 = time.time()
    while not (tmp_path / "c" / "gmts-s0" / "ckpt-000000").exists() and time.time() - t0 < 240:
        time.sleep(0.5)
    children = [int(p) for p in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
    assert children
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.count("\n") == 1 and "interrupted" in err, err
    time.sleep(1)
    alive = [c for c in children if os.path.exists(f"/proc/{c}") and "Z" not in open(f"/proc/{c}/stat").read()
             .split()[2]]
    assert not alive


def test_a_stop_signal_while_starting_is_one_line(tmp_path):
    """Ctrl-C while torch still imports (the first seconds): one line and exit 130, not an import traceback."""
    proc = _start([*SMOKE, "--out", str(tmp_path / "o")], tmp_path)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("gmts: error: interrupted")


def test_resume_may_switch_the_tracker(tmp_path, monkeypatch):
    """--report-to changes where metrics go, not the trajectory: a resume may change it without --allow-change."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = str(tmp_path / "run")
    gmts.main(["--preset", "smoke", "--steps", "1", "--out", out])
    gmts.main(["--resume", out, "--steps", "2", "--report-to", "tensorboard"])
    assert [r["step"] for r in gmts.read_metrics(out)] == [0, 1, 2]
    assert os.listdir(os.path.join(out, "tensorboard"))


# ---- issue 29: paths resolved once, the data a run read, the command line's edges --------------------------------

def test_a_resume_from_any_folder_reproduces_the_run_with_kl(tmp_path, finished, monkeypatch):
    """--model given relative to the first working folder is stored absolute: a resume from another folder, where
    a folder of the same name holds another model, loads the run's own KL reference and ends bit for bit where the
    uninterrupted run ends. The same folder spelled ./m or absolute is no change."""
    from safetensors.torch import load_file
    monkeypatch.setitem(gmts.TASKS["countdown"], "reward", parity_reward)
    for d in ("a", "b"):
        os.makedirs(tmp_path / d)
    shutil.copytree(finished / "ckpt-000001", tmp_path / "a" / "m")
    shutil.copytree(finished / "ckpt-000002", tmp_path / "b" / "m")  # another model under the same name
    flags = [*SMALL, "--model", "m", "--kl-beta", "0.5", "--lr", "1e-2", "--warmup-steps", "0", "--no-lr-decay",
             "--save-every", "1"]
    monkeypatch.chdir(tmp_path / "a")
    gmts.main([*flags, "--steps", "3", "--out", str(tmp_path / "whole")])
    gmts.main([*flags, "--steps", "2", "--out", str(tmp_path / "part")])
    monkeypatch.chdir(tmp_path / "b")
    gmts.main(["--resume", str(tmp_path / "part"), "--steps", "3"])
    whole, part = gmts.read_metrics(str(tmp_path / "whole")), gmts.read_metrics(str(tmp_path / "part"))
    assert [r["kl"] for r in part[1:]] == [r["kl"] for r in whole[1:]] and whole[-1]["kl"] > 0
    new, old = load_file(str(tmp_path / "part" / "model.safetensors")), load_file(str(tmp_path / "whole" /
                                                                                       "model.safetensors"))
    assert all(torch.equal(new[k], old[k]) for k in old)
    monkeypatch.chdir(tmp_path / "a")
    for spelled in ("./m", str(tmp_path / "a" / "m"), "../a/m"):
        assert gmts.parse_args(["--resume", str(tmp_path / "part"), "--model", spelled]).model == str(
            tmp_path / "a" / "m")


def test_the_data_fingerprint_is_of_the_bytes_the_run_read(tmp_path, monkeypatch, capsys):
    """A data file replaced after it was read (here: while the model loads) leaves the fingerprint of the rows the
    run trains on, so a resume refuses the replacement in one line."""
    import hashlib
    first = "".join(json.dumps({"nums": [n, 2, 3], "target": n + 5}) + "\n" for n in range(8))
    path = _write(tmp_path / "d.jsonl", first)
    real = gmts.load_model

    def load_and_replace(*a, **k):
        _write(tmp_path / "d.jsonl", first.replace("+ 5", "").replace('"target": 1', '"target": 2'))
        return real(*a, **k)
    monkeypatch.setattr(gmts, "load_model", load_and_replace)
    gmts.main([*SMALL, "--data", path, "--steps", "1", "--out", str(tmp_path / "r")])
    saved = json.loads((tmp_path / "r" / "run_config.json").read_text())["fingerprint"]["data"]
    assert saved == {"size": len(first), "sha256": hashlib.sha256(first.encode()).hexdigest()}
    monkeypatch.setattr(gmts, "load_model", real)
    with pytest.raises(SystemExit) as e:
        gmts.main(["--resume", str(tmp_path / "r"), "--steps", "2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "not the file the run started with" in err and err.count("\n") == 1, err


def test_decoy_writes_nothing_so_checks_no_out(tmp_path, finished, monkeypatch, capsys):
    """decoy from a working folder it may not write: it reads a model and prints a table, so --out is never tested
    (a read-only working folder refused it on 09cce72)."""
    def refuse(out):
        raise ValueError(f"--out {out!r} is not a folder that can be written")
    monkeypatch.setattr(gmts, "check_out_path", refuse)
    os.makedirs(tmp_path / "ro")
    os.chmod(tmp_path / "ro", 0o555)
    monkeypatch.chdir(tmp_path / "ro")
    ev = gmts_lab.decoy_main(gmts.Config(model=str(finished), eval_size=2, max_new_tokens=4))
    gmts_lab.main(["decoy", "--model", str(finished), "--eval-size", "2", "--max-new-tokens", "4"])
    assert "| model | held-out greedy acc" in capsys.readouterr().out and set(ev) >= {"real_acc", "decoy_acc"}
    assert os.listdir(tmp_path / "ro") == []


def test_a_run_with_stdout_closed_finishes(tmp_path):
    """python gmts.py ... >&- (stdout closed, not a pipe): the run goes on to its end and exits 0."""
    cmd = " ".join([*SMOKE[:-4], "--steps", "2", "--out", str(tmp_path / "o")]) + " >&-"
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=ENV1, timeout=300)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert [x["step"] for x in gmts.read_metrics(str(tmp_path / "o"))] == [0, 1, 2]
    assert (tmp_path / "o" / "model.safetensors").exists()


def test_a_stop_signal_after_done_changes_nothing(tmp_path):
    """Ctrl-C in the seconds of teardown after `done:`: everything is saved, so exit 0 and nothing on stderr (on
    09cce72: 'interrupted while starting', exit 130)."""
    proc = _start([*SMOKE[:-4], "--steps", "1", "--out", str(tmp_path / "o")], tmp_path)
    assert "done: " in _wait_for(proc, "done: ")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and err == "", err
    assert (tmp_path / "o" / "model.safetensors").exists()


# ---- issue 38: the fresh probe's cases that end in a success, each failing on 47c0a22 ----------------------------

@pytest.mark.parametrize("case", ["resume run[1] beside run1", "resume solo[1]", "new run into run[12]"])
def test_a_folder_name_with_glob_characters_reaches_no_other_run(tmp_path, finished, capsys, monkeypatch, case):
    """checkpoints() globbed OUT/ckpt-*: `run[1]` matched run1's checkpoints (a resume from another run, whose
    rotation then deleted run1's), `solo[1]` matched none (a silent fresh start that deleted its own), and a new run
    into `run[12]` rotated run1's away. Each run now sees exactly its own folder."""
    monkeypatch.setitem(gmts.TASKS["countdown"], "reward", parity_reward)
    other = shutil.copytree(finished, tmp_path / "run1")
    shutil.rmtree(other / "ckpt-000002")  # another run, one checkpoint behind
    before = snapshot(other)
    if case == "new run into run[12]":
        gmts.main([*SMALL, "--steps", "1", "--save-every", "1", "--overwrite", "--out", str(tmp_path / "run[12]")])
        assert [os.path.basename(c) for c in gmts.checkpoints(str(tmp_path / "run[12]"))] == ["ckpt-000000",
                                                                                              "ckpt-000001"]
    else:
        out = shutil.copytree(finished, tmp_path / ("run[1]" if case.startswith("resume run") else "solo[1]"))
        gmts.main(["--resume", str(out), "--steps", "3"])
        assert f"resuming from {out / 'ckpt-000002'}" in capsys.readouterr().out
        assert [r["step"] for r in gmts.read_metrics(str(out))] == [0, 1, 2, 3]
    assert snapshot(other) == before


def test_a_stdout_that_cannot_encode_a_character_does_not_stop_the_run(tmp_path, monkeypatch):
    """PYTHONIOENCODING=ascii and a non-ASCII --out: the lines are written with escapes and the run ends, exit 0
    (on 47c0a22 the UnicodeEncodeError, a ValueError, ended it as bad input, exit 2)."""
    import io
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="ascii"))
    gmts.main([*SMALL, "--steps", "1", "--out", str(tmp_path / "é")])
    sys.stdout.flush()
    assert b"done: " in raw.getvalue() and b"\\xe9" in raw.getvalue()
    assert [r["step"] for r in gmts.read_metrics(str(tmp_path / "é"))] == [0, 1]


def test_a_resume_after_metrics_jsonl_is_gone_goes_on(tmp_path, capsys):
    """A run stopped after ckpt-000000, its metrics.jsonl deleted: the resume trains steps 1 and 2 (on 47c0a22 the
    tracker's read_metrics(...)[0] was an IndexError traceback)."""
    out = str(tmp_path / "o")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gmts, "policy_update", _raise(KeyboardInterrupt))
        with pytest.raises(SystemExit):
            gmts.main([*SMALL, "--steps", "2", "--out", out])
    os.remove(os.path.join(out, "metrics.jsonl"))
    capsys.readouterr()
    gmts.main(["--resume", out])
    assert [r["step"] for r in gmts.read_metrics(out)] == [1, 2] and capsys.readouterr().err == ""


def test_the_rows_of_a_data_file_are_tokenized_in_bounded_chunks(tmp_path, monkeypatch):
    """check_prompts tokenized every row of a data file in one call (200k rows: 11 GB); now at most 1024 rows go to
    the tokenizer at once, however long the file."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    rows = "".join(json.dumps({"nums": [n % 9 + 1, 2, 3], "target": n % 9 + 6}) + "\n" for n in range(2500))
    data = _write(tmp_path / "d.jsonl", rows)
    real, sizes = PreTrainedTokenizerBase.__call__, []

    def tokenize(self, text=None, *a, **k):
        sizes.append(len(text) if isinstance(text, list) else 1)
        return real(self, text, *a, **k)
    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", tokenize)
    gmts.main([*SMALL, "--data", data, "--steps", "1", "--out", str(tmp_path / "o")])
    assert sum(sizes) >= 2500 and max(sizes) <= 1024, sizes


def test_compare_into_a_closed_stdout_finishes_the_grid(tmp_path):
    """gmts_lab.py compare ... | head -1: the table is written and the exit is 0 (on 47c0a22 the second print's
    BrokenPipeError ended the grid with no table)."""
    cmd = " ".join([sys.executable, os.path.join(HERE, "gmts_lab.py"), "compare", "--preset", "smoke", "--steps", "1",
                    "--methods", "all", "--seeds", "1", "--workers", "1", "--out", str(tmp_path / "c")]) + " | head -1"
    r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, env=ENV1, timeout=300)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert (tmp_path / "c" / "compare.md").read_text().startswith("| method |")


def test_compare_starts_no_more_workers_than_runs(tmp_path, monkeypatch, capsys):
    """--workers 8 for one run: one process, and the line says so (on 47c0a22: 8 processes, 7 of them idle)."""
    import multiprocessing
    asked = []

    class Context:
        def Pool(self, n, *a, **k):
            asked.append(n)
            raise KeyboardInterrupt
    monkeypatch.setattr(multiprocessing, "get_context", lambda kind: Context())
    with pytest.raises(SystemExit):
        gmts_lab.main(["compare", "--preset", "smoke", "--methods", "all", "--seeds", "1", "--workers", "8", "--out",
                       str(tmp_path / "c")])
    assert asked == [1] and "in 1 process(es)" in capsys.readouterr().out


# ---- any causal LM starts (issue 44 item 5) ----------------------------------------------------

def _byte_level_folder(folder, kind):
    """A GPT-2-style or GPT-NeoX-style tiny model built offline, saved with a byte-level
    tokenizer as theirs are: eos <|endoftext|>, no pad, no chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM,
                              PreTrainedTokenizerFast)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|endoftext|>",
                                  bos_token="<|endoftext|>", unk_token="<|endoftext|>")
    torch.manual_seed(0)
    if kind == "gpt2":  # n_embd, n_layer, n_head, n_inner None (4 d): no num_key_value_heads
        model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=len(tok),
                                           n_positions=512, bos_token_id=256, eos_token_id=256))
    else:  # intermediate_size, but no num_key_value_heads
        model = GPTNeoXForCausalLM(GPTNeoXConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            vocab_size=len(tok), max_position_embeddings=512, bos_token_id=256, eos_token_id=256))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("kind", ["gpt2", "neox"])
def test_a_gpt2_or_neox_model_starts_and_trains(tmp_path, capsys, kind):
    """gmts.main with a GPT-2-style or GPT-NeoX-style folder: its memory plan is printed (K and V
    for every head, d_ff from n_inner's fallback or intermediate_size) and two steps run (on
    e3741a4: AttributeError, no num_key_value_heads, before step 0)."""
    folder = _byte_level_folder(tmp_path / kind, kind)
    out = tmp_path / "o"
    gmts.main([*SMALL, "--model", folder, "--steps", "2", "--out", str(out)])
    said = capsys.readouterr().out
    assert "memory plan (GiB): weights" in said and "done:" in said, said
    assert [r["step"] for r in gmts.read_metrics(str(out))] == [0, 1, 2]


# ---- issue 44: files as they are now; issue 42 item 5: one epoch ---------------------------------

def test_a_csv_edited_and_given_back_its_mtime_is_read_as_it_is_now(tmp_path):
    """datasets' cache notices a change by modification time only: on e3741a4 the second read handed
    back the old golds (and the rows' fingerprint with them). Now the bytes' fingerprint and the
    rows are the file's as it is."""
    data = _write(tmp_path / "d.csv", MATH_CSV)
    rows, _, before = gmts.load_rows("math", data, 0, named=True)
    _same_mtime_edit(data, MATH_CSV.replace(",2\n", ",3\n"))
    again, _, after = gmts.load_rows("math", data, 0, named=True)
    assert rows[0]["answer"] == "2" and again[0]["answer"] == "3"
    with open(data, "rb") as f:
        raw = f.read()
    assert after == {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()} != before


def test_resume_compares_eval_data_by_name_and_real_path(tmp_path, capsys):
    """The same benchmark named through another path (a symbolic link) continues; on e3741a4 the
    strings differed and the resume was refused."""
    link = lambda tmp: os.symlink(tmp / "bench.jsonl", tmp / "link.jsonl")  # noqa: E731
    out = _bench_run(link)(tmp_path, None)
    gmts.main(["--resume", out, "--steps", "2", "--eval-data", f"b={tmp_path / 'link.jsonl'}"])
    assert [r["step"] for r in gmts.read_metrics(out)] == [0, 1, 2]


def test_a_long_prompt_is_refused_before_it_is_tokenized_whole(tmp_path, monkeypatch, capsys):
    """A 800,000-character question (under the cell cap): its head is tokenized, found past the
    positions and refused; on e3741a4 the whole prompt went through the tokenizer first."""
    from transformers import PreTrainedTokenizerBase
    rows = [{"question": "Ann has 3 apples.", "answer": "3"},
            {"question": "Bob has 5.", "answer": "5"},
            {"question": "Tom " * 200_000 + "has 4.", "answer": "4"}]
    data = _write(tmp_path / "d.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    seen = []
    real = PreTrainedTokenizerBase.__call__

    def tokenize(self, text, *a, **k):
        seen.extend(len(t) for t in ([text] if isinstance(text, str) else text))
        return real(self, text, *a, **k)
    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", tokenize)
    with pytest.raises(SystemExit) as e:
        gmts.main([*SMALL, "--task", "math", "--data", data, "--steps", "1", "--out",
                   str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "d.jsonl line 3: its first" in err and "positions" in err, err
    assert max(seen) < 100_000, max(seen)


def _epoch_run(tmp_path, monkeypatch, out, steps, resume=False):
    """A --data-order epoch run (or its resume) -> the rows each rollout batch drew by (step, k)."""
    drawn = {}
    real = gmts.read_data

    def read(cfg):
        data = real(cfg)
        draw = data.draw

        def spy(n, step, k):
            drawn[(step, k)] = [r["target"] for r in draw(n, step, k)]
            return [dict(nums=[t - 5, 2, 3], target=t) for t in drawn[(step, k)]]
        data.draw = spy
        return data
    monkeypatch.setattr(gmts, "read_data", read)
    rows = "".join(json.dumps({"nums": [n, 2, 3], "target": n + 5}) + "\n" for n in range(12))
    data = _write(tmp_path / "d.jsonl", rows)
    argv = [*SMALL, "--data", data, "--data-order", "epoch", "--no-lr-decay", "--eval-every", "2",
            "--steps", str(steps), "--out", str(out)]
    gmts.main(["--resume", str(out), "--steps", str(steps)] if resume else argv)
    return drawn


def test_data_order_epoch_passes_over_each_row_once_and_resumes_exactly(tmp_path, monkeypatch):
    """Issue 42 item 5: 4 steps in one go equal 2 steps and a resume to 4 (the same rows in every
    rollout batch, the same metrics), and the first 10 rows drawn are the 10 training rows, each
    once (12 rows, 2 held out). The tiny model earns nothing, so dynamic sampling draws 2 batches a
    step: the resume's place is counted from metrics.jsonl's rollout_batches, not from the step. On
    e3741a4 --data-order does not exist."""
    whole = _epoch_run(tmp_path, monkeypatch, tmp_path / "a", 4)
    first = _epoch_run(tmp_path, monkeypatch, tmp_path / "b", 2)
    rest = _epoch_run(tmp_path, monkeypatch, tmp_path / "b", 4, resume=True)
    assert whole == {**first, **rest} and len(whole) > 4
    order = [t for key in sorted(whole) for t in whole[key]]
    assert sorted(order[:10]) == list(range(7, 17))  # targets n + 5 of rows 2..11
    volatile = ("step_time_s", "tokens_per_s", "rollout_time_s")
    strip = [[{k: v for k, v in r.items() if k not in volatile} for r in gmts.read_metrics(o)]
             for o in (tmp_path / "a", tmp_path / "b")]
    assert strip[0] == strip[1]


def test_lab_analyze_honours_prompt_style(tmp_path, monkeypatch, capsys):
    """analyze --prompt-style qwen-math rolls out qwen-math prompts (e3741a4: ours, in silence)."""
    seen = []

    def rollout(model, tok, prompts, *a, **k):
        seen.extend(prompts)
        raise KeyboardInterrupt
    monkeypatch.setattr(gmts, "rollout", rollout)
    with pytest.raises(SystemExit):
        gmts_lab.main(["analyze", "--model", "tiny", "--task", "math", "--data", "easy",
                       "--prompt-style", "qwen-math", "--prompts-per-step", "2",
                       "--group-size", "2", "--max-new-tokens", "8", "--out", str(tmp_path / "a")])
    assert seen and all(gmts.QWEN_MATH_SYSTEM in p for p in seen), seen[:1]


# ---- issue 44: the grader tells the truth; faults in the real worker (each fails on e3741a4)

def _one_worker(monkeypatch):
    """A pool of one worker for this test, started: its process."""
    monkeypatch.setattr(gmts, "_VERIFIER", gmts._verifier_pool(1))
    assert gmts.latex_equal("1", "1") is True
    return gmts._VERIFIER["slots"][0]["proc"]


def _alive(pid):
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    return os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"


def test_a_stopped_worker_is_replaced_not_read_as_false(monkeypatch):
    """SIGSTOP to the worker: the verdict is asked again of a fresh worker (on e3741a4: False)."""
    monkeypatch.setattr(gmts, "VERIFY_TIMEOUT_S", 1.0)
    proc = _one_worker(monkeypatch)
    os.kill(proc.pid, signal.SIGSTOP)
    assert gmts.latex_equal("\\frac{1}{2}", "0.5") is True
    assert not _alive(proc.pid) and gmts._VERIFIER["unknown"] == 0


def test_a_worker_killed_mid_request_is_replaced_not_read_as_false(monkeypatch):
    """The worker stopped, then killed (SIGKILL) while the request waits: a fresh worker answers (on
    e3741a4: False)."""
    proc = _one_worker(monkeypatch)
    os.kill(proc.pid, signal.SIGSTOP)
    killer = threading.Timer(0.5, os.kill, (proc.pid, signal.SIGKILL))
    killer.start()
    assert gmts.latex_equal("\\frac{1}{2}", "0.5", 60) is True
    killer.join()
    assert gmts._VERIFIER["unknown"] == 0


def test_an_interrupted_wait_leaves_no_answer_for_the_next_call(monkeypatch):
    """Ctrl-C while `1 vs 2` waits (its worker stopped, then let go): the next calls get their own
    verdicts (on e3741a4 the stale answer: `2 vs 2` False, then `1 vs 2` True)."""
    proc = _one_worker(monkeypatch)
    os.kill(proc.pid, signal.SIGSTOP)

    def interrupt(*_):
        raise KeyboardInterrupt
    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        with pytest.raises(KeyboardInterrupt):
            gmts.latex_equal("1", "2", 60)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGCONT)  # a worker still alive answers the interrupted request
    time.sleep(1)
    assert gmts.latex_equal("2", "2") is True
    assert gmts.latex_equal("1", "2") is False
    assert not _alive(proc.pid)


def test_a_json_py_in_the_working_folder_does_not_break_grading(tmp_path, monkeypatch, capsys):
    """A user's json.py in the working folder: a math run on LaTeX golds trains (on e3741a4 the
    worker imported it and every run ended "math answers need math-verify", exit 2)."""
    _write(tmp_path / "json.py", "raise ImportError('the user\'s own json.py')\n")
    data = PLACES["latex_rows"](tmp_path, None)
    monkeypatch.setattr(gmts, "_VERIFIER", gmts._verifier_pool(1))  # started from that folder
    monkeypatch.chdir(tmp_path)
    gmts.main([*SMALL, "--task", "math", "--data", data, "--steps", "1", "--out",
               str(tmp_path / "o")])
    assert [r["step"] for r in gmts.read_metrics(str(tmp_path / "o"))] == [0, 1]
    assert capsys.readouterr().err == ""


def test_answers_without_a_verdict_are_counted_and_said(tmp_path, monkeypatch, capsys):
    """Below GRADE_UNKNOWN_MAX (here 1.0) the run goes on: metrics.jsonl counts the answers whose
    verdict did not come back (every training answer here: their worker stops itself, twice), the
    step line says so; the evaluation's verdicts all came back (on e3741a4: no count, no word)."""
    monkeypatch.setattr(gmts, "GRADE_UNKNOWN_MAX", 1.0)
    monkeypatch.setattr(gmts, "VERIFY_TIMEOUT_S", 1.0)
    monkeypatch.setattr(gmts, "math_reward", _boxed_gold(gmts.math_reward))
    stalls = _worker_that(STALL, '"729" in gold and got is not None')
    monkeypatch.setattr(gmts, "_VERIFY_WORKER", stalls)
    monkeypatch.setattr(gmts, "_VERIFIER", gmts._verifier_pool(1))
    data = PLACES["latex_rows"](tmp_path, None)
    out = str(tmp_path / "o")
    gmts.main([*SMALL, "--task", "math", "--data", data, "--steps", "1", "--prompts-per-step", "1",
               "--group-size", "2", "--no-filter-groups", "--out", out])
    recs = gmts.read_metrics(out)
    assert [r.get("grade_unknown") for r in recs] == [None, 2]
    assert [r.get("eval_grade_unknown") for r in recs] == [0, 0]
    assert [r.get("eval_acc") for r in recs] == [1.0, 1.0]  # the held-out golds, boxed
    assert "| grade_unknown 2 |" in capsys.readouterr().out
