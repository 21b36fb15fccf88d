"""Compare runs' metrics.jsonl line by line, exact floats, the timing keys left out
(issue 31's tool).

    python dev/cmp_metrics.py A/metrics.jsonl B/metrics.jsonl [C/metrics.jsonl ...]

The first file is the reference. For each other file it prints the first line that differs (with
every key that differs there), how many lines are identical, and the first step at which a key other
than the sampler-gap metrics differs (those two see the thread count's float noise in the KV-cache
decode; nothing trained reads them).
A developer tool: no test and no CI runs it.
"""
import json
import sys

TIMING = {"rollout_time_s", "step_time_s", "tokens_per_s"}


def load(path):
    rows = []
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            rows.append({k: v for k, v in row.items() if k not in TIMING})
    return rows


def differing_keys(a, b, skip_gap=False):
    keys = sorted(set(a) | set(b))
    if skip_gap:
        keys = [k for k in keys if not k.startswith("sampler_logp_gap")]
    return [k for k in keys if a.get(k) != b.get(k)]


def main(paths):
    runs = {p: load(p) for p in paths}
    for p, rows in runs.items():
        accs = [(r["step"], r["eval_acc"]) for r in rows if "eval_acc" in r]
        print(f"{p}: {len(rows)} lines, eval_acc {accs}")
    ref_path, ref = paths[0], runs[paths[0]]
    for p in paths[1:]:
        rows = runs[p]
        print(f"--- {ref_path} vs {p}")
        n = min(len(ref), len(rows))
        differing = [(a, b) for a, b in zip(ref, rows) if differing_keys(a, b)]
        if differing:
            a, b = differing[0]
            print(f"first differing line: step {a['step']}")
            for k in differing_keys(a, b):
                print(f"   {k}: {a.get(k)!r} vs {b.get(k)!r}")
        same = len(ref) == len(rows) and not differing
        print(f"identical lines: {n - len(differing)} of {n}" + ("  -> IDENTICAL" if same else ""))
        for a, b in differing:
            keys = differing_keys(a, b, skip_gap=True)
            if keys:
                shown = ", ".join(f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in keys[:6])
                print(f"first step where another key differs: {a['step']}: {shown}")
                break


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: python dev/cmp_metrics.py A/metrics.jsonl B/metrics.jsonl [...]")
    main(sys.argv[1:])
