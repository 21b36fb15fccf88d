"""How many seeds a paired comparison on the CPU toy needs to detect the GMTS paper's gain
(docs/results.md).

    python dev/seeds_needed.py            the table of docs/results.md, from dev/reviewer_runs.jsonl

The spread is measured, not assumed: for each pair of arms run on the same seeds
(dev/reviewer_runs.jsonl, 80 steps, final held-out accuracy), d_s = acc_a(s) - acc_b(s) per seed s
and sigma_d = their sample standard deviation (n - 1). The test is the one docs/results.md uses: a
two-sided paired t test at alpha = 0.05. Its power at n seeds for a true mean difference delta is
that of a noncentral t with n - 1 degrees of freedom and noncentrality delta / sigma_d * sqrt(n):

    power(n) = P(|T| > t_{1 - alpha/2, n - 1}),   T ~ t'(n - 1, delta * sqrt(n) / sigma_d)

and the seeds needed are the smallest n with power(n) >= 0.80. The normal approximation beside it is
n ~ ((z_{1 - alpha/2} + z_{0.80}) * sigma_d / delta)^2 = (2.8016 * sigma_d / delta)^2.
delta: the paper's reported gains of GMTS over the entropy baseline, +1.3 and +2.3 points of
accuracy.
The noncentral t is integrated numerically over the chi distribution of the sample SD (numpy and
torch's ndtr; no scipy in requirements.txt).
"""
import functools
import math
import os
import statistics
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reviewer_runs as rr  # noqa: E402

ALPHA, POWER = 0.05, 0.80
GAINS = (0.013, 0.023)  # the paper's +1.3 to +2.3 points


def _phi(x):
    return torch.special.ndtr(torch.from_numpy(np.asarray(x, dtype=np.float64))).numpy()


@functools.lru_cache(maxsize=None)
def _sd_grid(df: int):
    """(s, weights): a grid over S = sqrt(chi2_df / df) and its density times the step
    (sums to ~1)."""
    w = 15 / math.sqrt(2 * df)
    lo, hi = max(1e-9, 1 - w), 1 + w + (12 if df < 6 else 0)
    s = np.linspace(lo, hi, 40_001)
    v = df * s * s
    log_f = (df / 2 - 1) * np.log(v) - v / 2 - (df / 2) * math.log(2) - math.lgamma(df / 2)
    dens = np.exp(log_f) * 2 * df * s  # f_S(s) = f_V(df s^2) * 2 df s
    return s, dens * (s[1] - s[0])


def tail(c: float, df: int, ncp: float = 0.0) -> float:
    """P(|T| > c) for T ~ t'(df, ncp): E_S[P(Z > c S - ncp) + P(Z < -c S - ncp)]."""
    s, w = _sd_grid(df)
    return float(np.sum(w * ((1 - _phi(c * s - ncp)) + _phi(-c * s - ncp))))


@functools.lru_cache(maxsize=None)
def t_crit(df: int, alpha: float = ALPHA) -> float:
    """t_{1 - alpha/2, df} by bisection on the central t's two-sided tail."""
    lo, hi = 0.0, 100.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tail(mid, df) > alpha else (lo, mid)
    return (lo + hi) / 2


def power(n: int, delta: float, sd: float) -> float:
    return tail(t_crit(n - 1), n - 1, delta / sd * math.sqrt(n))


def seeds_needed(delta: float, sd: float) -> int:
    """The smallest n >= 2 with power(n) >= POWER (a coarse doubling, then bisection)."""
    hi = 2
    while power(hi, delta, sd) < POWER:
        hi *= 2
    lo = hi // 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if power(mid, delta, sd) < POWER else (lo, mid)
    return max(hi, 2)


def detectable(n: int, sd: float) -> float:
    """The true difference a paired t test on n seeds finds with POWER (bisection on delta)."""
    lo, hi = 0.0, 10 * sd
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if power(n, mid, sd) < POWER else (lo, mid)
    return hi


def sd_interval(sd: float, df: int) -> tuple:
    """95% interval of the true sigma_d from a sample SD on df degrees of freedom:
    sd * sqrt(df / chi2_q)."""
    s, w = _sd_grid(df)
    cdf = np.cumsum(w) / np.sum(w)  # of S = sqrt(chi2 / df)
    lo, hi = s[np.searchsorted(cdf, 0.025)], s[np.searchsorted(cdf, 0.975)]
    return sd / hi, sd / lo


def normal_n(delta: float, sd: float) -> float:
    return ((1.959964 + 0.841621) * sd / delta) ** 2


def main():
    # the tables' t values
    assert abs(t_crit(4) - 2.776445) < 1e-4 and abs(t_crit(9) - 2.262157) < 1e-4
    arms = rr.by_arm(rr.collect())
    pairs = [(("gmts", r, ""), ("entropy", r, "")) for r in rr.RHOS]
    pairs += [(("gmts", 0.2, ""), ("all", None, "")), (("entropy", 0.2, ""), ("all", None, ""))]
    print("| paired by seed (80 steps) | seeds | per-seed differences | sigma_d "
          "| n for +1.3 points (normal) | n for +2.3 points (normal) "
          "| found with 80% power at 5 seeds |")
    print("|---|---|---|---|---|---|---|")
    pooled = []
    for a, b in pairs:
        seeds = sorted(set(arms[a]) & set(arms[b]))
        d = [rr.final(arms[a][s]) - rr.final(arms[b][s]) for s in seeds]
        sd = statistics.stdev(d)
        if b[0] == "entropy":
            pooled.append((len(d) - 1, sd))
        cells = [f"{seeds_needed(g, sd)} ({normal_n(g, sd):.0f})" for g in GAINS]
        print(f"| {rr.name(a)} - {rr.name(b)} | {len(d)} | "
              f"{', '.join(f'{x:+.3f}' for x in d)} | {sd:.4f} | "
              + " | ".join(cells) + f" | {detectable(5, sd) * 100:.1f} points |")
    df = sum(k for k, _ in pooled)
    sd = math.sqrt(sum(k * s * s for k, s in pooled) / df)
    cells = [f"{seeds_needed(g, sd)} ({normal_n(g, sd):.0f})" for g in GAINS]
    print(f"| gmts - entropy, pooled over the five rho | {df} df | | {sd:.4f} | "
          + " | ".join(cells) + f" | {detectable(5, sd) * 100:.1f} points |")
    lo, hi = sd_interval(sd, df)
    print(f"\nThe pooled sigma_d is itself an estimate: its 95% interval on {df} df is "
          f"[{lo:.4f}, {hi:.4f}], "
          f"so the seeds for +1.3 points lie between {seeds_needed(GAINS[0], lo)} "
          f"and {seeds_needed(GAINS[0], hi)}, "
          f"for +2.3 points between {seeds_needed(GAINS[1], lo)} and {seeds_needed(GAINS[1], hi)}.")


if __name__ == "__main__":
    main()
