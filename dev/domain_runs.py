"""The authors' GMTS, our whole-batch variant and entropy on three tasks (docs/results.md), from their raw records.

    python dev/domain_runs.py        the table, from dev/domain_runs.jsonl

dev/domain_runs.jsonl holds one line per run: task, arm (gmts: per group, the authors'; gmts@batch: ours; entropy:
over the batch), seed, the commit of the export it ran from, torch's CPU kernels, the final held-out greedy accuracy
and the final truncated_frac. The runs were `gmts_lab.py compare` grids (commands in docs/results.md) whose folders
were not kept; their per-seed finals were printed to 3 decimals, and each is stored here as the k / 256 it rounds
from (256 held-out rows: two such fractions are 0.0039 apart, so the 3 decimals name one). Differences are paired by
seed with the 95% t interval of gmts_lab.ci95.
"""
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gmts_lab as lab  # noqa: E402

RUNS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "domain_runs.jsonl")
TASKS = ("countdown", "math", "logic")
ARMS = ("entropy", "gmts", "gmts@batch")
PAIRS = (("gmts", "entropy"), ("gmts@batch", "entropy"), ("gmts", "gmts@batch"))


def collect() -> dict:
    """{task: {arm: {seed: final}}}."""
    runs = collections.defaultdict(lambda: collections.defaultdict(dict))
    with open(RUNS) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                runs[r["task"]][r["arm"]][r["seed"]] = r["final"]
    return runs


def table(runs: dict) -> str:
    rows = ["| | " + " | ".join(TASKS) + " |", "|---|" + "---|" * len(TASKS)]
    for arm in ARMS:
        cells = []
        for task in TASKS:
            v = list(runs[task][arm].values())
            cells.append(f"{sum(v) / len(v):.3f} +- {lab._se(v):.3f}")
        rows.append(f"| {arm} | " + " | ".join(cells) + " |")
    for a, b in PAIRS:
        cells = []
        for task in TASKS:
            seeds = sorted(set(runs[task][a]) & set(runs[task][b]))
            d = [runs[task][a][s] - runs[task][b][s] for s in seeds]
            lo, hi = lab.ci95(d)
            cells.append(f"{sum(d) / len(d):+.3f} [{lo:+.3f}, {hi:+.3f}]")
        rows.append(f"| {a} - {b} | " + " | ".join(cells) + " |")
    seeds = ", ".join(f"{task} {len(runs[task][ARMS[0]])}" for task in TASKS)
    return "\n".join(rows) + f"\n\nseeds: {seeds}"


if __name__ == "__main__":
    print(table(collect()))
