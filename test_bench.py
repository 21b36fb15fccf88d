"""Smoke test of bench_gmts.py: --quick runs every section (the GPU step with a tiny config on CPU) and writes
the JSON the README table comes from. No timing assertions: timings on a shared machine are not a test."""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_bench_quick_writes_every_section(tmp_path):
    out = tmp_path / "tmp.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, os.path.join(HERE, "bench_gmts.py"), "--quick", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    R = json.loads(out.read_text())
    assert {"meta", "stats", "loss_head", "select", "step_tiny", "step_model", "targets"} <= set(R)
    assert {"naive", "ours@128", "ours@1024"} <= set(R["stats"])
    if R["meta"]["trl"]:
        assert "trl" in R["stats"]
    for r in R["stats"].values():  # every variant computed the same statistics
        assert r["max_abs_diff_logp"] < 1e-3 and r["max_abs_diff_entropy"] < 1e-3
    assert {"all", "selected"} <= set(R["loss_head"])
    assert any(k.endswith("/select_tokens") for k in R["select"])
    for key in ("step_tiny", "step_model"):
        S = R[key]
        assert S["rollout"]["tokens_per_s"] > 0 and S["step_ratio_gmts_all"] > 0
        assert S["all"]["kept_frac"] == 1.0 and 0 < S["gmts"]["kept_frac"] <= 0.25
        assert {"ms", "peak_mb", "step_ms", "select_ms", "select_share"} <= set(S["gmts"])
    names = [t["target"] for t in R["targets"]]
    assert len(names) >= 6 and all(isinstance(t["passed"], bool) for t in R["targets"])
    assert "targets" in p.stdout and ("PASS" in p.stdout or "FAIL" in p.stdout)
