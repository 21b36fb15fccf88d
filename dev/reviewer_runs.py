"""The reviewers' runs: accuracy over rho, rsi, KL and 240 steps (docs/results.md), from their raw records.

    python dev/reviewer_runs.py                          the tables, from dev/reviewer_runs.jsonl
    python dev/reviewer_runs.py --png docs/rho.png       ... and the accuracy-over-rho figure
    python dev/reviewer_runs.py --add FOLDER --commit SHA    record FOLDER's finished runs
    python dev/reviewer_runs.py --check JOB FOLDER       compare a re-run's eval curve
                                                         with JOB's record, every digit

FOLDER holds one folder per queued job (dev/reviewer_jobs.txt; dev/reviewer_queue.sh runs them),
each a `gmts_lab.py compare --seeds 1 --out FOLDER/JOB` run: JOB/METHOD-sSEED,
JOB = METHOD-rRHO-sSEED (the rho sweep), METHOD-rRHO-kl-sSEED (KL), METHOD-long-sSEED (240 steps),
all-sSEED, rsi-sSEED. Only finished runs are recorded (gmts_lab.finished_runs: the last eval at the
last step), one JSON line each: the job, the commit of the export it ran from, torch's CPU kernels
(torch.backends.cpu.get_cpu_capability(): a run on other kernels parts from the record;
ATEN_CPU_CAPABILITY=avx2 forces AVX2 ones), the CPU's model (added after the 85 runs: MKL's matrix
products differ by CPU as well), torch's version, its eval curve, final truncated_frac and mean kept
share. The job's flags are its line of dev/reviewer_jobs.txt. Differences are paired by seed, with
the 95% t interval of gmts_lab.ci95.
"""
import argparse
import collections
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gmts  # noqa: E402
import gmts_lab as lab  # noqa: E402

RHOS = (0.05, 0.1, 0.2, 0.5, 0.9)
JOB = re.compile(r"(?P<method>[a-z]+)(?:-r(?P<rho>[0-9.]+))?(?P<kl>-kl)?(?P<long>-long)?"
                 r"-s(?P<seed>[0-9]+)$")


RUNS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reviewer_runs.jsonl")


def arm_of(job: str):
    """JOB -> ((method, rho, kind), seed); kind '' (80 steps), 'kl' or 'long'; rho None for all
    and rsi."""
    m = JOB.match(job)
    kind = "kl" if m["kl"] else "long" if m["long"] else ""
    rho = float(m["rho"]) if m["rho"] else None
    if m["method"] in ("all", "rsi"):
        rho = None
    elif kind == "long":
        rho = 0.2
    return (m["method"], rho, kind), int(m["seed"])


def cpu_name() -> str:
    """This machine's CPU model as /proc/cpuinfo names it ('' where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f
                         if ln.startswith("model name")), "")
    except OSError:
        return ""


def add(folder: str, commit: str):
    """Append FOLDER's finished runs that dev/reviewer_runs.jsonl does not hold yet."""
    have = set()
    if os.path.exists(RUNS):
        with open(RUNS) as f:
            have = {json.loads(line)["job"] for line in f if line.strip()}
    kernels = torch.backends.cpu.get_cpu_capability()  # of this machine: run add where the runs ran
    # MKL's matrix products differ by CPU too, not only by kernels (docs/results.md)
    cpu = cpu_name()
    with open(RUNS, "a") as f:
        for job in sorted(os.listdir(folder)):
            if not JOB.match(job) or job in have:
                continue
            for method, by_seed in lab.finished_runs(os.path.join(folder, job)).items():
                for seed, curve in by_seed.items():
                    recs = gmts.read_metrics(os.path.join(folder, job, f"{method}-s{seed}"))
                    steps = [r for r in recs if "selected_frac" in r]
                    f.write(json.dumps(dict(
                        job=job, commit=commit, kernels=kernels, cpu=cpu, torch=torch.__version__,
                        curve=curve,
                        trunc=steps[-1].get("truncated_frac", float("nan")),
                        kept=round(sum(r["selected_frac"] for r in steps) / len(steps), 6))) + "\n")


def collect() -> dict:
    """{(arm, seed): the run's record} from dev/reviewer_runs.jsonl."""
    runs = {}
    with open(RUNS) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                runs[arm_of(r["job"])] = r
    return runs


def by_arm(runs: dict) -> dict:
    out = collections.defaultdict(dict)
    for (arm, seed), r in runs.items():
        out[arm][seed] = r
    return out


def name(arm) -> str:
    method, rho, kind = arm
    return method + (f" rho {rho:g}" if rho is not None else "") + (f" ({kind})" if kind else "")


def final(r) -> float:
    return r["curve"][-1][1]


def area(r) -> float:
    """The mean of eval_acc over the run's evaluations (steps 0, 10, ...): the area under the eval
    curve over the run's length, the evaluations being evenly spaced."""
    return sum(a for _, a in r["curve"]) / len(r["curve"])


def arm_rows(arms: dict, keys, metric=final) -> list:
    rows = ["| arm | seeds | mean +- SE | kept share | per seed (final truncated_frac) |",
            "|---|---|---|---|---|"]
    for arm in keys:
        if arm not in arms:
            continue
        s = arms[arm]
        v = [metric(s[k]) for k in sorted(s)]
        kept = sum(s[k]["kept"] for k in s) / len(s)
        per = ", ".join(f"s{k} {metric(s[k]):.3f} ({s[k]['trunc']:.2f})" for k in sorted(s))
        rows.append(f"| {name(arm)} | {len(v)} | {sum(v) / len(v):.3f} +- {lab._se(v):.3f} | "
                    f"{kept:.3f} | {per} |")
    return rows


SEEDS = 5  # the rule's paired seeds: an interval over fewer is shown, not counted


def verdict(lo: float, hi: float, n: int) -> str:
    if n < SEEDS:
        return f"not counted ({n} < {SEEDS} seeds)"
    return "yes" if lo > 0 or hi < 0 else "no"


def pair_rows(arms: dict, pairs, metric=final) -> list:
    rows = ["| paired by seed | seeds | mean difference +- SE | 95% interval (t) | excludes 0 "
            "| per seed |",
            "|---|---|---|---|---|---|"]
    for a, b in pairs:
        if a not in arms or b not in arms:
            continue
        seeds = sorted(set(arms[a]) & set(arms[b]))
        if len(seeds) < 2:
            continue
        d = [metric(arms[a][k]) - metric(arms[b][k]) for k in seeds]
        lo, hi = lab.ci95(d)
        rows.append(f"| {name(a)} - {name(b)} | {len(d)} | "
                    f"{sum(d) / len(d):+.3f} +- {lab._se(d):.3f} | "
                    f"[{lo:+.3f}, {hi:+.3f}] | {verdict(lo, hi, len(d))} | "
                    + ", ".join(f"{x:+.3f}" for x in d) + " |")
    return rows


def tables(arms: dict) -> str:
    A = ("all", None, "")
    rsi = ("rsi", None, "")
    sweep = [(m, r, "") for r in RHOS for m in ("gmts", "entropy")]
    out = ["### Accuracy over rho (80 steps)", *arm_rows(arms, [A, rsi] + sweep), ""]
    pairs = []
    for r in RHOS:
        g, e = ("gmts", r, ""), ("entropy", r, "")
        pairs += [(g, e), (g, A), (e, A)]
    out += ["#### At each rho", *pair_rows(arms, pairs), ""]
    flat = [((m, r, ""), (m, 0.9, "")) for m in ("gmts", "entropy") for r in RHOS if r != 0.9]
    out += ["#### Is the curve flat? (each rho against 0.9)", *pair_rows(arms, flat), ""]
    out += ["#### rsi",
            *pair_rows(arms, [(rsi, A), (rsi, ("entropy", 0.2, "")), (rsi, ("gmts", 0.2, ""))]),
            ""]
    long_ = [("gmts", 0.2, "long"), ("entropy", 0.2, "long"), ("all", None, "long")]
    lp = [(long_[0], long_[1]), (long_[0], long_[2]), (long_[1], long_[2])]
    out += ["### Longer runs (240 steps): final", *arm_rows(arms, long_), "",
            *pair_rows(arms, lp), "",
            "#### Area under the eval curve (mean eval_acc over the evaluations)",
            *arm_rows(arms, long_, area), "",
            *pair_rows(arms, lp, area), ""]
    kl = [("gmts", 0.2, "kl"), ("entropy", 0.2, "kl")]
    kp = [(kl[0], ("gmts", 0.2, "")), (kl[1], ("entropy", 0.2, "")), (kl[0], kl[1])]
    out += ["### KL (--kl-beta 0.001, rho 0.2)", *arm_rows(arms, kl), "", *pair_rows(arms, kp), ""]
    return "\n".join(out)


def plot(arms: dict, png: str):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.subplots()
    for i, m in enumerate(("gmts", "entropy")):
        xs = [r for r in RHOS if (m, r, "") in arms]
        for r in xs:
            v = [final(x) for x in arms[(m, r, "")].values()]
            ax.scatter([r * (1.04 if i else 0.96)] * len(v), v, s=8, color=f"C{i}", alpha=0.4)
        means = [sum(final(x) for x in arms[(m, r, "")].values()) / len(arms[(m, r, "")])
                 for r in xs]
        ses = [lab._se([final(x) for x in arms[(m, r, "")].values()]) for r in xs]
        ax.errorbar(xs, means, yerr=ses, color=f"C{i}", marker="o", capsize=3,
                    label=f"{m} (mean +- SE)")
        for r, y in zip(xs, means):  # a cell's seeds so far: the queue may not have finished it
            ax.annotate(f"n={len(arms[(m, r, '')])}", (r, y), textcoords="offset points",
                        xytext=(6, 10 if i else -14), color=f"C{i}", fontsize=7)
    for arm, style in ((("all", None, ""), "k--"), (("rsi", None, ""), "g:")):
        if arm in arms:
            v = [final(x) for x in arms[arm].values()]
            kept = sum(x["kept"] for x in arms[arm].values()) / len(v)
            label = "all tokens" if arm[0] == "all" else f"rsi [0.5, 2] (kept share {kept:.2f})"
            ax.axhline(sum(v) / len(v), linestyle=style[1:], color=style[0],
                       label=f"{label}, {len(v)} seeds")
    ax.set(xscale="log", xlabel="rho (share of tokens kept)",
           ylabel="final held-out accuracy (80 steps)",
           title="countdown, the cpu preset, seeds 0-4 (n: seeds finished)")
    ax.set_xticks(list(RHOS), [f"{r:g}" for r in RHOS])
    ax.legend(fontsize=8)
    fig.savefig(png, dpi=110)


def check(job: str, folder: str) -> bool:
    """Compare FOLDER's one finished run (a `compare --seeds 1` folder, as the queue writes it) with
    JOB's record: every evaluation's eval_acc as the exact float. Prints both curves; True when they
    are equal."""
    recs = [r for r in collect().values() if r["job"] == job]
    if not recs:
        raise SystemExit(f"reviewer_runs.py: no record of {job} in {RUNS}")
    runs = [curve for by_seed in lab.finished_runs(folder).values() for curve in by_seed.values()]
    if len(runs) != 1:
        raise SystemExit(f"reviewer_runs.py: {folder} holds {len(runs)} finished runs, not one")
    want, got = recs[0]["curve"], [list(point) for point in runs[0]]
    print(f"{job}: the record ran {recs[0]['commit']} on {recs[0]['kernels']} kernels, "
          f"torch {recs[0]['torch']}")
    print(f"  record:   {want}\n  this run: {got}")
    print("equal to every digit" if got == want else "DIFFERENT")
    return got == want


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--add", default=None,
                   help="a folder of job folders whose finished runs to record")
    p.add_argument("--commit", default=None,
                   help="with --add: the commit the runs' export was made from")
    p.add_argument("--png", default=None)
    p.add_argument("--check", nargs=2, metavar=("JOB", "FOLDER"), default=None,
                   help="compare FOLDER's run with JOB's record, every digit "
                        "(exit 1 if they differ)")
    a = p.parse_args()
    if a.check:
        sys.exit(0 if check(*a.check) else 1)
    if a.add:
        if not a.commit:
            p.error("--add needs --commit")
        add(a.add, a.commit)
    arms = by_arm(collect())
    print(tables(arms))
    if a.png:
        plot(arms, a.png)


if __name__ == "__main__":
    main()
