"""bench_gmts.py, command by command: each runs at its --quick size, prints its ratios and writes
the same in its JSON; its bad input is one line, exit 2. No timing is asserted (timings on a
shared machine are not a test); what is: the variants compute the same numbers, each ratio is
the quotient of the measurements it names, and the memory plan's terms by hand. `plan` runs with
the hub reachable: importing bench_gmts leaves HF_HUB_OFFLINE alone."""
import dataclasses
import json
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
TESTDATA = os.path.join(HERE, "testdata")


def run(capsys, tmp_path, *argv) -> tuple:
    """bench_gmts.main(argv) at --quick, -> (its JSON, the ratios it printed)."""
    out = tmp_path / f"{argv[0]}.json"
    R = bench_gmts.main([*argv, "--quick", "--json", str(out)])
    printed = capsys.readouterr().out
    assert json.loads(out.read_text()) == json.loads(json.dumps(R))
    ratios = dict(re.findall(r"^  (.+?) +(\S+)$", printed.split("\nratios\n")[1], re.M))
    assert ratios == {k: f"{v:.3g}" for k, v in R["ratios"].items()}, printed
    return R, ratios


def test_stats_variants_agree_and_ratios_are_their_quotients(capsys, tmp_path):
    R, _ = run(capsys, tmp_path, "stats")
    S, L, sel, ratios = (R["results"]["stats"], R["results"]["loss_head"],
                         R["results"]["select"], R["ratios"])
    assert {"naive", "ours@128", "ours@1024"} <= set(S) and ("trl" in S) == R["meta"]["trl"]
    for k, r in S.items():  # every variant computed the same statistics, to 2e-6
        assert r["max_abs_diff_logp"] <= 2e-6 and r["max_abs_diff_entropy"] <= 2e-6, (k, r)
    assert set(L) == {"all", "selected", "all@1024"}
    assert ratios["loss head time selected / all"] == L["selected"]["ms"] / L["all"]["ms"]
    assert ratios["stats time ours@128 / naive"] == S["ours@128"]["ms"] / S["naive"]["ms"]
    loop, fast = sel["group 4x4x64/literal_loop"], sel["group 4x4x64/select_tokens"]
    assert fast["same_kept_tokens"] is True  # the authors' token loop keeps the same tokens
    assert ratios["authors' loop / select_tokens per group"] == loop["ms"] / fast["ms"]
    assert {"16384/select_tokens", "16384/quantile", "65536/select_tokens"} <= set(sel)


def test_step_ratios_against_trl_and_the_kept_share(capsys, tmp_path):
    R, _ = run(capsys, tmp_path, "step")
    res, ratios = R["results"], R["ratios"]
    assert res["all"]["kept_frac"] == 1.0 and 0 < res["gmts"]["kept_frac"] <= 0.25
    assert res["rollout"]["tokens_per_s"] > 0 and res["N"] == 4
    assert ratios["step time gmts / all"] == res["gmts"]["step_ms"] / res["all"]["step_ms"]
    assert ratios["step 6 (omega, scores, selection) / gmts step"] == res["gmts"]["select_share"]
    if R["meta"]["trl"]:  # TRL's GRPOTrainer stepped on the same model and prompts
        trl = res["trl"]
        assert len(trl["step_ms_runs"]) == 2 and trl["step_ms"] > 0, trl
        assert ratios["step time gmts / TRL GRPOTrainer"] == res["gmts"]["step_ms"] / trl["step_ms"]


def test_rollout_sampler_gap_is_small_and_zero_in_fp32(capsys, tmp_path):
    R, _ = run(capsys, tmp_path, "rollout")
    old, new = R["results"]["fp32 master"], R["results"]["bf16 sampler"]
    assert old["sampler_logp_gap_max"] < 1e-5  # fp32 sampler, fp32 learner: the same numbers
    assert 0 < new["sampler_logp_gap"] <= new["sampler_logp_gap_max"] < 0.1  # bf16: small, not 0
    assert new["static_cache"] is True  # --quick: the static cache on the CPU too
    assert (R["ratios"]["tokens/s bf16 sampler / fp32 master"]
            == new["tokens_per_s"] / old["tokens_per_s"])


def test_memory_measures_every_phase_beside_the_plan(capsys, tmp_path):
    R, _ = run(capsys, tmp_path, "memory")
    phases = R["results"]["phases"]
    assert set(phases) == {"sampling", "statistics", "update", "AdamW step", "evaluation"}
    for name in ("sampling", "statistics", "update"):
        r = phases[name]
        assert r["plan_mb"] > 0 and R["ratios"][f"{name}: measured / plan"] == (r["peak_mb"]
                                                                             / r["plan_mb"])


def test_grading_grades_each_gold_as_one_in_the_main_thread(capsys, tmp_path):
    """Two of testdata's benchmark slices, each answer its own gold boxed: every grade is 1.0
    (math-verify ran: a grade off the main thread raises), avg@2 grades each row twice, and
    answers/s is the count over the median pass."""
    data = f"m={TESTDATA}/math500.jsonl,o={TESTDATA}/olympiadbench.jsonl"
    R, _ = run(capsys, tmp_path, "grading", "--grade-data", data)
    g = R["results"]
    assert {k: (s["rows"], s["grades"], s["acc"]) for k, s in g["sets"].items()} == {
        "m": (10, 20, 1.0), "o": (10, 20, 1.0)}
    assert (g["samples"], g["grades"]) == (2, 40) and len(g["seconds_runs"]) == 2
    assert R["ratios"]["answers per second"] == g["grades"] / g["seconds"]


def test_trl_select_times_the_selection_pass(capsys, tmp_path):
    pytest.importorskip("trl")
    R, _ = run(capsys, tmp_path, "trl-select")
    runs = R["results"]["runs"]
    assert [(r["num_iterations"], r["lr"]) for r in runs] == [(1, 3e-4), (2, 3e-4), (2, 1e-3)]
    for r in runs:
        assert 0 < r["select_s"] < r["total_s"] and r["select_share"] == r["select_s"] / r["total_s"]
    assert runs[0]["changed_share"] is None and 0 <= runs[1]["changed_share"] <= 1


BAD_INPUTS = [  # (argv, part of the one line)
    (["stats", "--rho", "2"], "--rho must be in (0, 1]"),
    (["step", "--shape", "huge"], "invalid choice: 'huge'"),
    (["rollout", "--repeats", "0"], "--repeats must be >= 1"),
    (["memory", "--plan-hidden", "0"], "--plan-hidden must be >= 1"),
    (["grading", "--grade-data", "x={d}/nogold.jsonl"], "nogold.jsonl row 2 has no answer"),
    (["grading", "--grade-data", "{d}/nogold.jsonl"], "--grade-data"),
    (["grading", "--grade-data", "x={d}/missing.jsonl"], "cannot read it"),
    (["trl-select", "--trl-select-steps", "-1"], "--trl-select-steps must be >= 0"),
    (["stats", "--json", "{d}/no/such/folder/x.json"], "not a file in an existing folder"),
    (["plan", "--model", "tiny", "--rho", "2"], "--rho must be"),
    (["plan", "--model", "{d}"], "cannot load model"),
    (["plan", "--model", "{d}/config.json"], "give --prompt-tokens P"),
    (["plan", "--model", "tiny", "--prompt-tokens", "-3"], "--prompt-tokens must be >= 1"),
    (["tune"], "invalid choice: 'tune'"),
]


@pytest.mark.parametrize("argv, needle", BAD_INPUTS, ids=[" ".join(c[0]) for c in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, needle):
    (tmp_path / "nogold.jsonl").write_text('{"problem": "p", "answer": "1"}\n{"problem": "q"}\n')
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        bench_gmts.main([a.format(d=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("bench_gmts: error: ") and needle in err, err
    assert err.count("\n") == 1, err


# ---- the memory plan (`bench_gmts.py plan`) --------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model():
    model, tok = gmts.build_tiny(hidden=32, layers=2, seed=0)
    return model.float().eval(), tok


def test_the_memory_plan_by_hand(tiny_model):
    """memory_plan's terms for the tiny model on a CPU (4-byte activations, no sampler copy), each
    phase written out and made the largest in turn: sampling (the KV cache of all B*G answers of
    one generate() call and the prefill of their prompts), the same with --rollout-rows,
    evaluation (--eval-samples k: max(64 // k, 1) * k answers a rollout) and the update
    (gradients, what the layers keep, the loss head's chunk, at most the micro-batch's tokens); a
    device too small gets the first fix that fits, or the flags to lower when none does."""
    model, _ = tiny_model
    n = sum(p.numel() for p in model.parameters())  # d 32, 2 layers, 4 heads of 8, 2 KV, d_ff 64
    cpu, P, T = torch.device("cpu"), 28, 100
    kv = 2 * 2 * 2 * 8 * 4  # K and V, layers, KV heads, head size, fp32
    forward = 4 * (2 * 32 + 3 * 64 + 4 * P)  # a prefill per token (CPU: 4 heads x P scores)
    stay = {"weights": 4 * n, "AdamW": 8 * n, "KL reference": 4 * n}
    plan, line = bench_gmts.memory_plan, bench_gmts.memory_line

    def gib(parts):
        return pytest.approx({k: v / 2**30 for k, v in parts.items()}, rel=1e-12)
    cfg = gmts.Config(prompts_per_step=64, group_size=16, max_new_tokens=T, kl_beta=0.1,
                      micro_batch=2)
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
    kept = 2 * layer + 4 * (2 * 32 + 3 * 64 + 4 * (P + T))  # 2 layers, backward's temporaries
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
    """GPT-2 (n_embd, n_layer, n_head; n_inner None: 4 d) and GPT-NeoX (no num_key_value_heads)
    by hand; a config without the sizes: the plan is unknown, said in one line."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM
    cpu, P = torch.device("cpu"), 10
    cfg = gmts.Config(prompts_per_step=64, group_size=16, max_new_tokens=10)
    with torch.device("meta"):
        gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=300))
        neox = GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=32, num_hidden_layers=3,
                                                num_attention_heads=4, intermediate_size=48,
                                                vocab_size=300))
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


def _hand_line(n: int, P: int, T: int, rows: int) -> str:
    """The plan of the 32-wide tiny model on this CPU with sampling the largest phase, by hand."""
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    parts = {"weights": 4 * n, "AdamW": 8 * n, "KV cache": 2 * 2 * 2 * 8 * 4 * rows * (P + T),
             "prefill": rows * 4 * (2 * 32 + 3 * 64 + 4 * P) * P}
    gib = {k: v / 2**30 for k, v in parts.items()}
    return ("memory plan (GiB): " + ", ".join(f"{k} {v:.2f}" for k, v in gib.items())
            + f" = {sum(gib.values()):.2f} of {have:.1f} on cpu")


def test_plan_prints_the_hand_formula_for_a_model_folder(tmp_path, tiny_model, capsys):
    """`bench_gmts.py plan` end to end on a saved tiny model whose weights file is deleted (the
    plan reads the config alone): P is the longest prompt of the run in tokens (here bytes: the
    tokenizer is byte-level), first a TRAINING row of --data's file (the two held-out rows are
    short), then a longer --eval-data question, then --prompt-tokens as given; 4 x 1024 answers
    make sampling the largest phase, and each token of P moves the prefill by ~0.02 GiB, so the
    printed two decimals check P exactly. The JSON holds the same parts."""
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

    def P(question: str) -> int:  # no system line (--short-prompt), no chat template, a byte a token
        return len(f"User: {question}\nAssistant: {gmts.ASSISTANT_PREFIX}".encode())
    flags = ["plan", "--model", str(folder), "--task", "math", "--data", data, "--eval-size", "2",
             "--short-prompt", "--chat-template", "no", "--device", "cpu", "--prompts-per-step",
             "4", "--group-size", "1024", "--max-new-tokens", str(T), "--micro-batch", "1"]
    for extra, longest in (([], P("r" * 120)), (["--eval-data", f"b={bench}"], P("u" * 150)),
                           (["--prompt-tokens", "300"], 300)):
        printed = bench_gmts.main(flags + extra + ["--json", str(tmp_path / "plan.json")])
        assert capsys.readouterr().out == printed + "\n"  # the one line the command prints
        hand = _hand_line(n, longest, T, rows)
        assert printed == hand or printed.startswith(hand + "; too much"), printed
        saved = json.loads((tmp_path / "plan.json").read_text())
        assert saved["line"] == printed and saved["prompt_tokens"] == longest


def test_plan_reads_a_config_file_or_a_hub_id_without_weights(tmp_path, tiny_model, capsys,
                                                              monkeypatch):
    """Offline from a config.json alone (with --prompt-tokens), and from a hub id: AutoConfig and
    AutoTokenizer are asked for that id (here answered with the tiny model's), no weights."""
    import transformers
    model, tok = tiny_model
    model.config.save_pretrained(tmp_path)
    n = sum(p.numel() for p in model.parameters())
    flags = ["--device", "cpu", "--prompts-per-step", "4", "--group-size", "1024",
             "--max-new-tokens", "50", "--micro-batch", "1"]
    printed = bench_gmts.main(["plan", "--model", str(tmp_path / "config.json"),
                               "--prompt-tokens", "90", *flags])
    hand = _hand_line(n, 90, 50, 4096)
    assert printed == hand or printed.startswith(hand + "; too much"), printed
    asked = []

    def config(path, *a, **k):
        asked.append(path)
        return model.config
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", config)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda path, *a, **k: asked.append(path) or tok)
    printed = bench_gmts.main(["plan", "--model", "someone/some-model", "--short-prompt",
                               "--chat-template", "no", "--task", "math", "--data", "easy",
                               *flags])
    assert asked == ["someone/some-model", "someone/some-model"]
    assert printed.startswith("memory plan (GiB): weights"), printed
    capsys.readouterr()


def test_importing_bench_leaves_the_hub_online():
    """bench_gmts and gmts set no HF_HUB_OFFLINE: `plan --model HUB_ID` can reach the hub."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    code = ("import os, bench_gmts, huggingface_hub.constants as c; "
            "print(os.environ.get('HF_HUB_OFFLINE'), c.HF_HUB_OFFLINE)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=HERE, timeout=300)
    assert p.returncode == 0 and p.stdout.split() == ["None", "False"], p.stdout + p.stderr
