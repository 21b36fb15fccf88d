"""Smoke test of bench_gmts.py: --quick runs every section (the GPU step with a tiny config on CPU) and writes
its JSON (docs/results.md's source for GPU figures). No timing assertions: timings on a shared machine are not a test. What is
asserted: the variants compute the same statistics (to 2e-6), the printed PASS/FAIL verdicts
are the JSON's, and section e fills the rollout keys (old vs new rollout path, sampler/learner gap, TRL step).
Below: the memory plan (`bench_gmts.py plan`, moved here from gmts.py) by hand and end to end, and section h's
main-thread grading."""
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import types

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest
import torch

import bench_gmts
import gmts

HERE = os.path.dirname(os.path.abspath(__file__))


def test_bench_quick_writes_every_section(tmp_path):
    out = tmp_path / "tmp.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, os.path.join(HERE, "bench_gmts.py"), "--quick", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    R = json.loads(out.read_text())
    assert {"meta", "stats", "loss_head", "select", "step_tiny", "step_model", "targets"} <= set(R)
    plan = R["memory_plan"]["phases"]  # the memory plan's phases beside measured peaks
    assert {"sampling", "statistics", "update", "AdamW step", "evaluation"} <= set(plan)
    for name in ("sampling", "statistics", "update"):
        r = plan[name]
        assert r["plan_mb"] > 0 and r["ratio"] == r["peak_mb"] / r["plan_mb"]
    assert {"naive", "ours@128", "ours@1024"} <= set(R["stats"])
    if R["meta"]["trl"]:
        assert "trl" in R["stats"]
    for k, r in R["stats"].items():  # every variant computed the same statistics, to 2e-6
        assert r["max_abs_diff_logp"] <= 2e-6 and r["max_abs_diff_entropy"] <= 2e-6, (k, r)
    assert {"all", "selected"} <= set(R["loss_head"])
    assert any(k.endswith("/select_tokens") for k in R["select"])
    for key in ("step_tiny", "step_model"):
        S = R[key]
        assert S["rollout"]["tokens_per_s"] > 0 and S["step_ratio_gmts_all"] > 0
        assert S["all"]["kept_frac"] == 1.0 and 0 < S["gmts"]["kept_frac"] <= 0.25
        assert {"ms", "peak_mb", "step_ms", "select_ms", "select_share"} <= set(S["gmts"])

    # the old and the new rollout path side by side, and the sampler/learner gap
    paths = R["step_model"]["rollout_paths"]
    assert paths["new"]["sampler_dtype"] == "bf16" and paths["new"]["fast_generate"] is True  # --quick: static
    assert R["rollout_speedup"] == paths["speedup"] > 0
    assert paths["speedup"] == paths["new"]["tokens_per_s"] / paths["old"]["tokens_per_s"]
    assert paths["old"]["sampler_logp_gap_max"] < 1e-5  # fp32 sampler, fp32 learner: the same numbers
    assert R["sampler_logp_gap"] == paths["new"]["sampler_logp_gap"]
    assert 0 < R["sampler_logp_gap"] <= R["sampler_logp_gap_max"] < 0.1  # a bf16 sampler: small but not 0
    trl = R["step_model"]["trl"]
    if R["meta"]["trl"]:  # TRL's GRPOTrainer stepped on the same model and batch
        assert trl["step_ms"] > 0 and len(trl["step_ms_runs"]) == 2, trl
        assert R["step_ratio_gmts_trl"] == R["step_model"]["step_ratio_gmts_trl"] > 0
    else:
        assert "error" in trl and R["step_ratio_gmts_trl"] is None

    # the targets: each verdict follows from its value, and the printed table says what the JSON says
    assert len(R["targets"]) >= 6
    for t in R["targets"]:
        assert t["passed"] == (t["value"] <= t["limit"])
    printed = {name: verdict for verdict, name in re.findall(r"^  (PASS|FAIL)  (.+?) +\S+  \(<= ", p.stdout, re.M)}
    assert printed == {t["target"]: "PASS" if t["passed"] else "FAIL" for t in R["targets"]}
    assert all(math.isfinite(t["value"]) for t in R["targets"])


def test_bench_threads_section_structure(tmp_path):
    """Section f (threads) at its tiny size: 1 step of the smoke preset at --threads 1 and 0, one fresh process
    each. Its figures are the machine's, so only their shape is checked, and that --threads 0 got torch's default
    for this machine although this test's own environment pins OMP_NUM_THREADS=1."""
    out = tmp_path / "threads.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, os.path.join(HERE, "bench_gmts.py"), "--sections", "f", "--quick",
                        "--repeats", "1", "--json", str(out)], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    R = json.loads(out.read_text())
    assert "stats" not in R and "step_tiny" not in R  # only the section asked for
    T = R["threads"]
    assert (T["preset"], T["steps"], T["repeats"]) == ("smoke", 1, 1)
    assert set(T["variants"]) == {"1", "0"}
    default = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], text=True,
                             capture_output=True, env={k: v for k, v in env.items() if k != "OMP_NUM_THREADS"})
    assert T["variants"]["1"]["torch_threads"] == 1
    assert T["variants"]["0"]["torch_threads"] == int(default.stdout)
    for v, r in T["variants"].items():
        assert r["threads_asked"] == int(v) and r["steps_per_s_runs"] and r["wall_s_runs"]
        assert r["steps_per_s"] > 0 and r["wall_s"] > 0 and 0 <= r["eval_acc"] <= 1
        assert r["metrics_identical"] is True and r["metrics_first_difference"] is None  # one run: itself
    assert T["ratio"] == T["variants"]["1"]["steps_per_s"] / T["variants"]["0"]["steps_per_s"]
    d = T["metrics_first_difference_across"]
    assert T["metrics_identical_across"] == (d is None)
    assert d is None or {"step", "key", "a", "b"} == set(d)
    assert (d is None) == (T["metrics_keys_differing_across"] == []) and (d is None or d["key"] in
                                                                        T["metrics_keys_differing_across"])
    rows = re.findall(r"^f threads +(--threads \d|ratio 1 / 0)", p.stdout, re.M)
    assert rows == ["--threads 1", "--threads 0", "ratio 1 / 0"]


def test_first_difference():
    a = [dict(step=0, eval_acc=0.25), dict(step=1, loss=0.5, kl=0.0)]
    assert bench_gmts.first_difference(a, [dict(r) for r in a]) is None
    assert bench_gmts.first_difference(a, [a[0], dict(a[1], kl=1e-9)]) == dict(step=1, key="kl", a=0.0, b=1e-9)
    assert bench_gmts.first_difference(a, a[:1]) == dict(step=1, key="step", a=1, b=None)  # b has no step 1


# ---- the memory plan (`bench_gmts.py plan`) --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model():
    model, tok = gmts.build_tiny(hidden=32, layers=2, seed=0)
    return model.float().eval(), tok


def test_the_memory_plan_by_hand(tiny_model):
    """memory_plan's terms for the tiny model on a CPU (4-byte activations, no sampler copy), each
    phase written out and made the largest in turn: sampling (the KV cache of all B*G answers of one
    generate() call and the prefill of their prompts), the same with --rollout-rows, evaluation
    (--eval-samples k: max(64 // k, 1) * k answers a rollout) and the update (gradients, what the
    layers keep, the loss head's chunk, at most the micro-batch's tokens); a device too small gets
    the first fix that fits, or the flags to lower when none does."""
    model, _ = tiny_model
    n = sum(p.numel() for p in model.parameters())  # d 32, 2 layers, 4 heads of 8, 2 KV, d_ff 64
    cpu, P, T = torch.device("cpu"), 28, 100
    kv = 2 * 2 * 2 * 8 * 4  # K and V, layers, KV heads, head size, fp32
    forward = 4 * (2 * 32 + 3 * 64 + 4 * P)  # a prefill per token (CPU: 4 heads x P scores)
    stay = {"weights": 4 * n, "AdamW": 8 * n, "KL reference": 4 * n}
    plan, line = bench_gmts.memory_plan, bench_gmts.memory_line

    def gib(parts):
        return pytest.approx({k: v / 2**30 for k, v in parts.items()}, rel=1e-12)
    cfg = gmts.Config(prompts_per_step=64, group_size=16, max_new_tokens=T, kl_beta=0.1, micro_batch=2)
    assert plan(cfg, model, P, cpu) == gib(dict(stay, **{
        "KV cache": kv * 1024 * (P + T), "prefill": 1024 * forward * P}))
    rows = dataclasses.replace(cfg, rollout_rows=100, eval_samples=64)  # 6 prompts x 16
    assert plan(rows, model, P, cpu) == gib(dict(stay, **{
        "KV cache": kv * 96 * (P + T), "prefill": 96 * forward * P}))
    ev = dataclasses.replace(cfg, prompts_per_step=1, group_size=2, eval_samples=80)
    assert plan(ev, model, P, cpu) == gib(dict(stay, **{
        "eval KV cache": kv * 80 * (P + T), "eval prefill": 80 * forward * P}))
    up = gmts.Config(prompts_per_step=1, group_size=2, max_new_tokens=T, micro_batch=64)
    layer = 4 * (9 * 32 + 4 * 64 + 4 * (P + T))  # what one layer keeps per token, fp32
    kept = 2 * layer + 4 * (2 * 32 + 3 * 64 + 4 * (P + T))  # 2 layers, and backward's temporaries
    assert plan(up, model, P, cpu) == gib({
        "weights": 4 * n, "AdamW": 8 * n, "gradients": 4 * n, "activations": kept * 64 * (P + T),
        "loss head": 16 * 1024 * 259})
    need = sum(plan(up, model, P, cpu).values())
    ckpt = sum(plan(dataclasses.replace(up, grad_ckpt=True), model, P, cpu).values())
    assert ckpt < need  # with 2 layers, checkpointing keeps one layer's activations at a time
    got = line(up, model, P, cpu, have=ckpt)
    assert got.startswith("memory plan (GiB): weights"), got
    assert got.endswith("too much: --grad-ckpt fits"), got
    got = line(up, model, P, cpu, have=ckpt * 0.99)
    assert got.endswith("too much: --grad-ckpt --micro-batch 1 fits"), got
    got = line(up, model, P, cpu, have=1e-9)
    assert got.endswith("--eval-samples or --max-new-tokens"), got
    assert "too much" not in line(up, model, P, cpu, have=need)
    big = sum(plan(cfg, model, P, cpu).values())
    fits = sum(plan(dataclasses.replace(cfg, rollout_rows=512), model, P, cpu).values())
    got = line(cfg, model, P, cpu, have=fits)
    assert big > 1.5 * fits
    assert got.endswith("too much: --rollout-rows 512 fits"), got  # sampling's own fix, first


def test_the_memory_plan_reads_other_configs():
    """GPT-2 (n_embd, n_layer, n_head; n_inner None: 4 d) and GPT-NeoX (no num_key_value_heads) by
    hand; a config without the sizes: the plan is unknown, said in one line."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM
    cpu, P = torch.device("cpu"), 10
    cfg = gmts.Config(prompts_per_step=64, group_size=16, max_new_tokens=10)
    with torch.device("meta"):
        gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=300))
        neox = GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                                intermediate_size=48, vocab_size=300))
    for model, layers, d_ff in ((gpt2, 2, 128), (neox, 3, 48)):
        plan = bench_gmts.memory_plan(cfg, model, P, cpu)
        assert plan["KV cache"] == 2 * layers * 4 * 8 * 4 * 1024 * (P + 10) / 2**30  # all 4 heads
        assert plan["prefill"] == 1024 * 4 * (2 * 32 + 3 * d_ff + 4 * P) * P / 2**30
    blank = types.SimpleNamespace(config=types.SimpleNamespace(), parameters=lambda: iter(()))
    assert bench_gmts.memory_plan(cfg, blank, P, cpu) == {}
    line = bench_gmts.memory_line(cfg, blank, P, cpu)
    assert line.startswith("memory plan: unknown for this architecture"), line


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_plan_prints_the_hand_formula_for_a_model_folder(tmp_path, tiny_model, capsys):
    """`bench_gmts.py plan` end to end on a saved tiny model whose weights file is deleted (the plan
    reads the config alone): P is the longest prompt of the run in tokens (here bytes: the tokenizer
    is byte-level), first a TRAINING row of --data's file (the two held-out rows are short), then a
    longer --eval-data question; 4 x 1024 answers make sampling the largest phase, and each token of
    P moves the prefill by ~0.02 GiB, so the printed two decimals check P exactly."""
    model, tok = tiny_model
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    n = sum(p.numel() for p in model.parameters())
    questions = ["What is 1 + 1?", "What is 2 + 2?", "q" * 40, "r" * 120, "s" * 60, "t" * 30]
    data = _jsonl(tmp_path / "train.jsonl", [{"question": q, "answer": "1"} for q in questions])
    bench = _jsonl(tmp_path / "bench.jsonl", [{"question": "u" * 150, "answer": "2"}])
    T, rows = 50, 4 * 1024
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30

    def hand(question: str) -> str:  # no system line (--short-prompt), no chat template, one token a byte
        P = len(f"User: {question}\nAssistant: {gmts.ASSISTANT_PREFIX}".encode())
        parts = {"weights": 4 * n, "AdamW": 8 * n, "KV cache": 2 * 2 * 2 * 8 * 4 * rows * (P + T),
                 "prefill": rows * 4 * (2 * 32 + 3 * 64 + 4 * P) * P}
        gib = {k: v / 2**30 for k, v in parts.items()}
        return ("memory plan (GiB): " + ", ".join(f"{k} {v:.2f}" for k, v in gib.items())
                + f" = {sum(gib.values()):.2f} of {have:.1f} on cpu")
    flags = ["plan", "--model", str(folder), "--task", "math", "--data", data, "--eval-size", "2",
             "--short-prompt", "--chat-template", "no", "--device", "cpu", "--prompts-per-step", "4",
             "--group-size", "1024", "--max-new-tokens", str(T), "--micro-batch", "1"]
    for extra, longest in (([], "r" * 120), (["--eval-data", f"b={bench}"], "u" * 150)):
        printed = bench_gmts.main(flags + extra)
        assert capsys.readouterr().out == printed + "\n"  # the one line the command prints
        assert printed == hand(longest) or printed.startswith(hand(longest) + "; too much"), printed


def test_plan_errors_are_one_line(tmp_path, capsys):
    """A folder with no model in it and a bad flag value: gmts.run_cli's one line, exit 2."""
    for flags, needle in ((["--model", str(tmp_path)], "cannot load model"),
                          (["--model", "tiny", "--rho", "2"], "--rho must be")):
        with pytest.raises(SystemExit) as e:
            bench_gmts.main(["plan", *flags])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("bench_gmts: error: ") and needle in err, err
        assert err.count("\n") == 1, err


def test_grading_section_grades_in_the_main_thread(tmp_path):
    """Section h on two small sets, each answer its own gold boxed: every grade is 1.0 (math-verify
    ran: a grade off the main thread raises), avg@2 grades each row twice, and answers/s is the count
    over the median pass."""
    a = _jsonl(tmp_path / "a.jsonl", [{"problem": "p", "answer": "\\frac{1}{2}"}, {"problem": "q", "answer": "x^2+1"}])
    b = _jsonl(tmp_path / "b.jsonl", [{"problem": "r", "answer": "3"}])
    args = bench_gmts.parse_args(["--quick", "--sections", "h", "--grade-data", f"a={a},b={b}"])
    g = bench_gmts.sec_grading(args, None, None)
    assert (g["samples"], g["grades"]) == (2, 6)
    assert {k: (s["rows"], s["grades"], s["acc"]) for k, s in g["sets"].items()} == {"a": (2, 4, 1.0),
                                                                                    "b": (1, 2, 1.0)}
    assert g["answers_per_s"] == g["grades"] / g["seconds"] and len(g["seconds_runs"]) == 1
