"""The code domain's comparison (docs/results.md): all, random, entropy and gmts x 5 seeds at the
cpu preset's scale, from their raw records.

    python dev/code_runs.py                              the tables, from dev/code_runs.jsonl
    python dev/code_runs.py --add FOLDER --commit SHA    record FOLDER's finished compare runs

FOLDER is a `gmts_lab.py compare --task code` output (METHOD-sSEED run folders; only finished runs
are recorded, gmts_lab.finished_runs). One JSON line per run: task, arm, seed, the commit it ran
from, torch's CPU kernels (torch.backends.cpu.get_cpu_capability() where --add runs: the runs'
machine), torch's version, the eval curve [[step, held-out greedy accuracy], ...], the final
accuracy, the final truncated_frac and the mean kept share (selected_frac). The tables: the final
accuracy, and the area under the eval curve (its mean over the evaluations). Differences are
paired by seed, with the 95% t interval of gmts_lab.ci95; one counts only if it excludes 0.
"""
import argparse
import collections
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gmts  # noqa: E402
import gmts_lab as lab  # noqa: E402

RUNS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "code_runs.jsonl")
ARMS = ("all", "random", "entropy", "gmts")
PAIRS = (("gmts", "entropy"), ("gmts", "all"), ("gmts", "random"), ("entropy", "all"),
         ("random", "all"), ("entropy", "random"))


def add(folder: str, commit: str):
    """Append FOLDER's finished runs to RUNS (a run already recorded is refused: ValueError)."""
    have = {(r["arm"], r["seed"]) for r in collect_lines()}
    runs = lab.finished_runs(folder)
    trunc = lab.final_truncated(folder, runs)
    with open(RUNS, "a") as f:
        for arm, by_seed in sorted(runs.items()):
            for seed, curve in sorted(by_seed.items()):
                if (arm, seed) in have:
                    raise ValueError(f"{arm} seed {seed} is recorded already in {RUNS}")
                recs = gmts.read_metrics(os.path.join(folder, f"{arm}-s{seed}"))
                kept = [r["selected_frac"] for r in recs if "selected_frac" in r]
                line = dict(task="code", arm=arm, seed=seed, commit=commit,
                            kernels=torch.backends.cpu.get_cpu_capability(),
                            torch=torch.__version__, curve=curve, final=curve[-1][1],
                            trunc=trunc[arm][seed], kept=round(sum(kept) / len(kept), 6))
                f.write(json.dumps(line) + "\n")


def collect_lines() -> list:
    if not os.path.exists(RUNS):
        return []
    with open(RUNS) as f:
        return [json.loads(line) for line in f if line.strip()]


def table(lines: list, measure: str = "final") -> str:
    """Per arm (mean +- SE, per seed) and paired by seed: the final held-out accuracy, or with
    measure="area" the mean of the eval curve over its evaluations (steps 0, 10, ..., 80): how
    early a run learns, where every arm ends near 1."""
    final = collections.defaultdict(dict)
    start = collections.defaultdict(dict)
    for r in lines:
        area = sum(a for _, a in r["curve"]) / len(r["curve"])
        final[r["arm"]][r["seed"]] = r["final"] if measure == "final" else area
        start[r["arm"]][r["seed"]] = r["curve"][0][1]
    seeds = sorted({s for by_seed in final.values() for s in by_seed})
    head = " | ".join(f"s{s}" for s in seeds)
    rows = [f"| arm | step 0 | {measure}, mean +- SE | {head} |",
            "|---|---|---|" + "---|" * len(seeds)]
    for arm in ARMS:
        v = [final[arm][s] for s in seeds if s in final[arm]]
        if not v:
            continue
        s0 = sum(start[arm].values()) / len(start[arm])
        cells = " | ".join(f"{final[arm][s]:.3f}" if s in final[arm] else "" for s in seeds)
        rows.append(f"| {arm} | {s0:.3f} | {sum(v) / len(v):.3f} +- {lab._se(v):.3f} | {cells} |")
    rows += ["", "| paired by seed | mean difference [95% t] | excludes 0 | "
             + " | ".join(f"s{s}" for s in seeds) + " |", "|---|---|---|" + "---|" * len(seeds)]
    for a, b in PAIRS:
        both = [s for s in seeds if s in final[a] and s in final[b]]
        d = [final[a][s] - final[b][s] for s in both]
        if len(d) < 2:
            continue
        lo, hi = lab.ci95(d)
        cells = " | ".join(f"{final[a][s] - final[b][s]:+.3f}" if s in both else ""
                           for s in seeds)
        rows.append(f"| {a} - {b} | {sum(d) / len(d):+.3f} [{lo:+.3f}, {hi:+.3f}] | "
                    f"{'yes' if lo > 0 or hi < 0 else 'no'} | {cells} |")
    return "\n".join(rows)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--add", metavar="FOLDER", help="record a compare folder's finished runs")
    p.add_argument("--commit", help="the commit those runs ran from (with --add)")
    a = p.parse_args()
    if a.add:
        if not a.commit:
            p.error("--add needs --commit")
        add(a.add, a.commit)
    print(table(collect_lines()) + "\n\n" + table(collect_lines(), "area"))
