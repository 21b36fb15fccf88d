"""The four arms on the commonsense toy (docs/results.md), from their raw records.

    python dev/commonsense_runs.py                          the tables, from the records
    python dev/commonsense_runs.py --add FOLDER --commit SHA    record FOLDER's finished runs

FOLDER is a `gmts_lab.py compare --task commonsense` --out (METHOD-sSEED run folders). Only
finished runs are recorded (gmts_lab.finished_runs: the last eval at the last step), one JSON line
each in dev/commonsense_runs.jsonl: task, arm, seed, the commit of the export it ran from, torch's
CPU kernels and version, the CPU's model, the eval curve (held-out greedy accuracy by step), the
final accuracy, the final truncated_frac and the mean kept share. The tables are
gmts_lab.report_tables' (paired by seed, the 95% t interval of gmts_lab.ci95).
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
from reviewer_runs import cpu_name  # noqa: E402

RUNS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "commonsense_runs.jsonl")
EXTRA_PAIRS = (("gmts", "random"), ("entropy", "all"), ("random", "all"))  # beyond lab.PAIRS


def add(folder: str, commit: str):
    """Append FOLDER's finished runs that RUNS does not hold yet (by arm and seed)."""
    have = {(r["arm"], r["seed"]) for r in read()}
    kernels = torch.backends.cpu.get_cpu_capability()  # of this machine: add where the runs ran
    with open(RUNS, "a") as f:
        for arm, by_seed in sorted(lab.finished_runs(folder).items()):
            for seed, curve in sorted(by_seed.items()):
                if (arm, seed) in have:
                    continue
                path = os.path.join(folder, f"{arm}-s{seed}")
                steps = [r for r in gmts.read_metrics(path) if "selected_frac" in r]
                f.write(json.dumps(dict(
                    task=lab.run_config(path)["task"], arm=arm, seed=seed, commit=commit,
                    kernels=kernels, cpu=cpu_name(), torch=torch.__version__, curve=curve,
                    final=curve[-1][1], trunc=steps[-1]["truncated_frac"],
                    kept=round(sum(r["selected_frac"] for r in steps) / len(steps), 6))) + "\n")


def read() -> list:
    if not os.path.exists(RUNS):
        return []
    with open(RUNS) as f:
        return [json.loads(line) for line in f if line.strip()]


def tables(recs: list) -> str:
    """gmts_lab.report_tables of the records (gmts - entropy and gmts - all among its pairs), then
    EXTRA_PAIRS in its format, then the mean kept share per arm and what the runs ran on."""
    runs, trunc = collections.defaultdict(dict), collections.defaultdict(dict)
    for r in recs:
        runs[r["arm"]][r["seed"]] = [tuple(x) for x in r["curve"]]
        trunc[r["arm"]][r["seed"]] = r["trunc"]
    lines = [lab.report_tables(dict(runs), dict(trunc))]
    for a, b in EXTRA_PAIRS:
        seeds = sorted(set(runs.get(a, {})) & set(runs.get(b, {})))
        d = [runs[a][s][-1][1] - runs[b][s][-1][1] for s in seeds]
        if len(d) < 2:
            continue
        lo, hi = lab.ci95(d)
        lines.append(f"| {a} - {b} | {len(d)} | {sum(d) / len(d):+.3f} +- {lab._se(d):.3f} | "
                     f"[{lo:+.3f}, {hi:+.3f}] | {'yes' if lo > 0 or hi < 0 else 'no'} | "
                     + ", ".join(f"{x:+.3f}" for x in d) + " |")
    kept = {arm: sum(r["kept"] for r in recs if r["arm"] == arm) / len(runs[arm]) for arm in runs}
    meta = sorted({(r["commit"], r["kernels"], r["torch"], r["cpu"]) for r in recs})
    lines.append("\nmean kept share: " + ", ".join(f"{a} {k:.3f}" for a, k in kept.items()))
    lines.append("ran on: " + "; ".join(", ".join(m) for m in meta))
    return "\n".join(lines)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--add", metavar="FOLDER")
    p.add_argument("--commit", help="with --add: the commit the runs ran from")
    a = p.parse_args()
    if a.add:
        if not a.commit:
            p.error("--add needs --commit")
        add(a.add, a.commit)
    print(tables(read()))
