"""The behaviour fingerprint of gmts.py: short runs across tasks, methods, KL, inner updates,
dynamic sampling, the bf16 sampler, the static cache and a kill-free resume; each run's metrics line
for line (timings left out), the sha256 of its final weights, and `--help`. A refactor that claims
to change nothing must leave it identical.

    python dev/fingerprint.py OUT.json [--repo DIR]     fingerprint the gmts.py in DIR
                                                        (default: this checkout)
    python dev/fingerprint.py --diff A.json B.json      what differs between two fingerprints
                                                        (exit 1 if anything)

One thread per run (OMP_NUM_THREADS=1), offline; about two minutes on one core.
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

TIMING = {"rollout_time_s", "step_time_s", "tokens_per_s", "grade_time_s"}  # wall times
SMOKE = ["--preset", "smoke", "--steps", "3", "--eval-every", "2", "--max-new-tokens", "64",
         "--prompts-per-step", "4", "--lr", "3e-4", "--eval-size", "16"]
RUNS = {  # name -> flags after `python gmts.py`
    "countdown_gmts": SMOKE + ["--select", "gmts"],
    "countdown_all_selected_nostd": SMOKE + ["--select", "all", "--loss-norm", "selected",
                                             "--no-std-normalize"],
    "countdown_random_bf16_static": SMOKE + ["--select", "random", "--sampler-dtype", "bf16",
                                             "--fast-generate"],
    "countdown_entropy_filter_off": SMOKE + ["--select", "entropy", "--no-filter-groups",
                                             "--group-size", "8"],
    "math_entropy_kl_inner2": SMOKE + ["--task", "math", "--model", "{repo}/warm/math",
                                       "--select", "entropy", "--kl-beta", "0.05",
                                       "--inner-updates", "2"],
    "logic_gradnorm_bf16_static": SMOKE + ["--task", "logic", "--model", "{repo}/warm/logic",
                                           "--select", "gradnorm", "--sampler-dtype", "bf16",
                                           "--fast-generate"],
    "countdown_kl": SMOKE + ["--kl-beta", "0.1", "--lr", "1e-3"],
    "countdown_4_steps": SMOKE + ["--steps", "4", "--save-every", "2"],
    # issue 35: the batch scope is the gmts of before (compare with an older fingerprint's
    # countdown_gmts); the authors' objective with its KL
    "countdown_gmts_batch": SMOKE + ["--select", "gmts", "--scope", "batch"],
    "countdown_gmts_seq_kl": SMOKE + ["--select", "gmts", "--loss-norm", "seq",
                                      "--kl-beta", "0.001"],
    # the code task (its sandboxed verifier) and the commonsense task (the boxed option)
    "code_gmts": SMOKE + ["--task", "code", "--model", "{repo}/warm/code", "--select", "gmts"],
    "commonsense_entropy": SMOKE + ["--task", "commonsense", "--model", "{repo}/warm/commonsense",
                                    "--select", "entropy"],
}


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def metrics(out: str) -> list:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in f]


def gmts(repo: str, args: list, cwd: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    p = subprocess.run([sys.executable, os.path.join(repo, "gmts.py"), *args], cwd=cwd, env=env,
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"gmts.py {' '.join(args)} exited {p.returncode}: "
                         f"{p.stderr.strip()[-500:]}")
    return p.stdout


def fingerprint(repo: str) -> dict:
    repo = os.path.abspath(repo)
    res = {"help": gmts(repo, ["--help"], repo)}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in RUNS.items():
            out = os.path.join(tmp, name)
            gmts(repo, [f.format(repo=repo) for f in flags] + ["--out", out], tmp)
            res[name] = {"metrics": metrics(out),
                         "weights": sha256(os.path.join(out, "model.safetensors"))}
        # 2 steps, then a resume to 4: must equal countdown_4_steps
        out = os.path.join(tmp, "resumed")
        gmts(repo, SMOKE + ["--steps", "2", "--save-every", "2", "--out", out], tmp)
        gmts(repo, ["--resume", out, "--steps", "4"], tmp)
        res["countdown_2_plus_2_steps"] = {
            "metrics": metrics(out), "weights": sha256(os.path.join(out, "model.safetensors"))}
    return res


def untimed(fp: dict) -> dict:
    """fp without TIMING's keys (a fingerprint from before one was added to TIMING still has it)."""
    def drop(rec):
        return {m: x for m, x in rec.items() if m not in TIMING}
    return {k: v if k == "help" else dict(v, metrics=[drop(r) for r in v["metrics"]])
            for k, v in fp.items()}


def diff(a: dict, b: dict) -> list:
    a, b = untimed(a), untimed(b)
    lines = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            lines.append(f"{key} differs")
            if key != "help" and key in a and key in b:
                for i, (x, y) in enumerate(zip(a[key]["metrics"], b[key]["metrics"])):
                    keys = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
                    if keys:
                        lines.append(f"  first at metrics line {i} (step {x.get('step')}): "
                                     f"{', '.join(keys)}")
                        break
    return lines


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out", nargs="?")
    p.add_argument("--repo", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p.add_argument("--diff", nargs=2, metavar=("A", "B"))
    a = p.parse_args()
    if a.diff:
        found = diff(*(json.load(open(x)) for x in a.diff))
        print("\n".join(found) or "identical")
        sys.exit(1 if found else 0)
    fp = fingerprint(a.repo)
    same = fp["countdown_2_plus_2_steps"]["weights"] == fp["countdown_4_steps"]["weights"]
    with open(a.out, "w") as f:
        json.dump(fp, f, indent=1)
    print(f"{a.out}: {len(RUNS) + 1} runs; resume equals the uninterrupted run: {same}")
