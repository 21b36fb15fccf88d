"""The selection arms on every domain at toy scale (docs/results.md, README's figure), from their
raw records in dev/domain_runs.jsonl.

    python dev/domain_runs.py                              every table
    python dev/domain_runs.py --add FOLDER --commit SHA    record a compare folder's finished runs
    python dev/domain_runs.py --png docs/domains.png       the figure: each domain's comparison

One JSON line per run: task, arm, seed, the commit of the export it ran from, torch's CPU kernels
and version, the final held-out greedy accuracy and the final truncated_frac. Runs recorded with
--add also keep the eval curve [[step, accuracy], ...], the mean kept share (selected_frac) and the
CPU's model. countdown, math and logic (entropy, gmts, gmts@batch; 2026-12-01) were
`gmts_lab.py compare` grids whose folders were not kept: their per-seed finals were printed to 3
decimals and are stored as the k / 256 they round from (256 held-out rows: two such fractions are
0.0039 apart, so 3 decimals name one). code and commonsense (all, random, entropy, gmts) were
recorded from their folders. Differences are paired by seed, with the 95% t interval of
gmts_lab.ci95; one counts only if it excludes 0.
"""
import argparse
import collections
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import gmts  # noqa: E402
import gmts_lab as lab  # noqa: E402
from reviewer_runs import cpu_name  # noqa: E402

RUNS = os.path.join(HERE, "domain_runs.jsonl")
TASKS = ("countdown", "math", "logic", "code", "commonsense")
ARMS = ("all", "random", "entropy", "gmts", "gmts@batch")  # the order of every table and panel
PAIRS = (("gmts", "entropy"), ("gmts@batch", "entropy"), ("gmts", "gmts@batch"), ("gmts", "all"),
         ("gmts", "random"), ("entropy", "all"), ("entropy", "random"), ("random", "all"))


def add(folder: str, commit: str):
    """Append FOLDER's finished runs (gmts_lab.finished_runs); a run recorded already (task, arm,
    seed) is refused, ValueError."""
    have = {(r["task"], r["arm"], r["seed"]) for r in read()}
    runs = lab.finished_runs(folder)
    trunc = lab.final_truncated(folder, runs)
    kernels = torch.backends.cpu.get_cpu_capability()  # of this machine: add where the runs ran
    lines = []
    for arm, by_seed in sorted(runs.items()):
        for seed, curve in sorted(by_seed.items()):
            path = os.path.join(folder, f"{arm}-s{seed}")
            task = lab.run_config(path)["task"]
            if (task, arm, seed) in have:
                raise ValueError(f"{task} {arm} seed {seed} is recorded already in {RUNS}")
            kept = [r["selected_frac"] for r in gmts.read_metrics(path) if "selected_frac" in r]
            lines.append(dict(task=task, arm=arm, seed=seed, commit=commit, kernels=kernels,
                              cpu=cpu_name(), torch=torch.__version__, curve=curve,
                              final=curve[-1][1], trunc=trunc[arm][seed],
                              kept=round(sum(kept) / len(kept), 6)))
    with open(RUNS, "a") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)


def read() -> list:
    if not os.path.exists(RUNS):
        return []
    with open(RUNS) as f:
        return [json.loads(line) for line in f if line.strip()]


def by_task(recs: list) -> dict:
    """{task: {arm: {seed: record}}}, arms in ARMS' order."""
    out = collections.defaultdict(lambda: collections.defaultdict(dict))
    for r in sorted(recs, key=lambda r: ARMS.index(r["arm"])):
        out[r["task"]][r["arm"]][r["seed"]] = r
    return out


def area(curve: list) -> float:
    """An eval curve's mean over its evaluations: how early a run learns, where every arm ends
    near 1."""
    return sum(acc for _, acc in curve) / len(curve)


def three_task_table(runs: dict) -> str:
    """countdown, math and logic side by side: entropy, gmts, gmts@batch (mean +- SE), and their
    paired differences [95% t]."""
    tasks = TASKS[:3]
    rows = ["| | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
    for arm in ("entropy", "gmts", "gmts@batch"):
        cells = []
        for task in tasks:
            v = [r["final"] for r in runs[task][arm].values()]
            cells.append(f"{sum(v) / len(v):.3f} +- {lab._se(v):.3f}")
        rows.append(f"| {arm} | " + " | ".join(cells) + " |")
    for a, b in PAIRS[:3]:
        cells = []
        for task in tasks:
            d = paired(runs[task], a, b)[1]
            lo, hi = lab.ci95(d)
            cells.append(f"{sum(d) / len(d):+.3f} [{lo:+.3f}, {hi:+.3f}]")
        rows.append(f"| {a} - {b} | " + " | ".join(cells) + " |")
    seeds = ", ".join(f"{task} {len(runs[task]['entropy'])}" for task in tasks)
    return "\n".join(rows) + f"\n\nseeds: {seeds}"


def paired(arms: dict, a: str, b: str) -> tuple:
    """(the seeds both arms ran, a's final accuracy minus b's on each)."""
    both = sorted(set(arms.get(a, {})) & set(arms.get(b, {})))
    return both, [arms[a][s]["final"] - arms[b][s]["final"] for s in both]


def curve_tables(arms: dict) -> str:
    """One domain with eval curves: gmts_lab.report_tables of the final accuracy, then of the
    curve's area, over every pair of PAIRS both arms ran."""
    curves = {arm: {s: [tuple(x) for x in r["curve"]] for s, r in by_seed.items()}
              for arm, by_seed in arms.items()}
    trunc = {arm: {s: r["trunc"] for s, r in by_seed.items()} for arm, by_seed in arms.items()}
    return (lab.report_tables(curves, trunc, pairs=PAIRS) + "\n\n"
            + lab.report_tables(curves, pairs=PAIRS, value=area, what="area (mean of the curve)"))


def about(arms: dict) -> str:
    """The mean kept share and final truncated_frac per arm, and what the runs ran on."""
    recs = [r for by_seed in arms.values() for r in by_seed.values()]
    kept = ", ".join(f"{arm} {sum(r['kept'] for r in v.values()) / len(v):.3f}"
                     for arm, v in arms.items())
    trunc = ", ".join(f"{arm} {max(r['trunc'] for r in v.values()):.3f}" for arm, v in arms.items())
    ran = "; ".join(", ".join(m) for m in sorted({(r["commit"], r["kernels"], r["torch"],
                                                   r.get("cpu", "")) for r in recs}))
    return f"mean kept share: {kept}\nlargest final truncated_frac: {trunc}\nran on: {ran}"


def tables(recs: list) -> str:
    runs = by_task(recs)
    out = ["## countdown, math, logic\n", three_task_table(runs)]
    for task in TASKS[3:]:
        if runs.get(task):
            out += [f"\n## {task}\n", curve_tables(runs[task]), "", about(runs[task])]
    return "\n".join(out)


def figure(recs: list, path: str):
    """A panel per domain: each seed's final accuracy per arm, a seed's arms joined by a grey line
    (the pairing), the arm's mean as a black bar, the mean step-0 accuracy dashed where known."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = by_task(recs)
    tasks = [t for t in TASKS if runs.get(t)]
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.2 * len(tasks), 3.4))
    for ax, task in zip(axes, tasks):
        arms = list(runs[task])
        for s in sorted({s for v in runs[task].values() for s in v}):
            xs = [i for i, a in enumerate(arms) if s in runs[task][a]]
            ax.plot(xs, [runs[task][arms[i]][s]["final"] for i in xs], color="0.75", lw=0.8,
                    marker="o", ms=3, mfc=f"C{s % 10}", mec="none", zorder=1)
        for i, a in enumerate(arms):
            v = [r["final"] for r in runs[task][a].values()]
            ax.hlines(sum(v) / len(v), i - 0.3, i + 0.3, color="k", lw=2, zorder=2)
        start = [r["curve"][0][1] for v in runs[task].values() for r in v.values() if "curve" in r]
        if start:
            ax.axhline(sum(start) / len(start), color="0.4", ls="--", lw=0.8, label="step 0")
            ax.legend(loc="lower right", fontsize=7)
        n = max(len(v) for v in runs[task].values())
        ax.set_xticks(range(len(arms)), arms, rotation=30, fontsize=8)
        ax.set_title(f"{task} ({n} seeds)", fontsize=10)
        ax.set_xlim(-0.5, len(arms) - 0.5)
    axes[0].set_ylabel("final held-out greedy accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--add", metavar="FOLDER", help="record a compare folder's finished runs")
    p.add_argument("--commit", help="with --add: the commit the runs ran from")
    p.add_argument("--png", metavar="PATH", help="draw every domain's comparison to PATH")
    a = p.parse_args()
    if a.add:
        if not a.commit:
            p.error("--add needs --commit")
        add(a.add, a.commit)
    if a.png:
        figure(read(), a.png)
    print(tables(read()))
