"""Smoke test of bench_gmts.py: --quick runs every section (the GPU step with a tiny config on CPU) and writes
the JSON the README table comes from. No timing assertions: timings on a shared machine are not a test. What is
asserted: the variants compute the same statistics (to the 2e-6 the README reports), the printed PASS/FAIL verdicts
are the JSON's, and section e fills issue 16's keys (old vs new rollout path, sampler/learner gap, TRL step)."""
import json
import math
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_bench_quick_writes_every_section(tmp_path):
    out = tmp_path / "tmp.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, os.path.join(HERE, "bench_gmts.py"), "--quick", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    R = json.loads(out.read_text())
    assert {"meta", "stats", "loss_head", "select", "step_tiny", "step_model", "targets"} <= set(R)
    plan = R["memory_plan"]["phases"]  # issue 42: the memory plan's phases beside measured peaks
    assert {"sampling", "statistics", "update", "AdamW step", "evaluation"} <= set(plan)
    for name in ("sampling", "statistics", "update"):
        r = plan[name]
        assert r["plan_mb"] > 0 and r["ratio"] == r["peak_mb"] / r["plan_mb"]
    assert {"naive", "ours@128", "ours@1024"} <= set(R["stats"])
    if R["meta"]["trl"]:
        assert "trl" in R["stats"]
    for k, r in R["stats"].items():  # every variant computed the same statistics, to the README's 2e-6
        assert r["max_abs_diff_logp"] <= 2e-6 and r["max_abs_diff_entropy"] <= 2e-6, (k, r)
    assert {"all", "selected"} <= set(R["loss_head"])
    assert any(k.endswith("/select_tokens") for k in R["select"])
    for key in ("step_tiny", "step_model"):
        S = R[key]
        assert S["rollout"]["tokens_per_s"] > 0 and S["step_ratio_gmts_all"] > 0
        assert S["all"]["kept_frac"] == 1.0 and 0 < S["gmts"]["kept_frac"] <= 0.25
        assert {"ms", "peak_mb", "step_ms", "select_ms", "select_share"} <= set(S["gmts"])

    # issue 16: the old and the new rollout path side by side, and the sampler/learner gap
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
    """Section f (issue 31) at its tiny size: 1 step of the smoke preset at --threads 1 and 0, one fresh process
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
    import bench_gmts
    a = [dict(step=0, eval_acc=0.25), dict(step=1, loss=0.5, kl=0.0)]
    assert bench_gmts.first_difference(a, [dict(r) for r in a]) is None
    assert bench_gmts.first_difference(a, [a[0], dict(a[1], kl=1e-9)]) == dict(step=1, key="kl", a=0.0, b=1e-9)
    assert bench_gmts.first_difference(a, a[:1]) == dict(step=1, key="step", a=1, b=None)  # b has no step 1
