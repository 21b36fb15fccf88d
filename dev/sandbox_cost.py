"""What one graded program costs in gmts.py's code sandbox, beside a bare Python start
(docs/design.md).

    python dev/sandbox_cost.py [--n 256]

Prints, per program, the CPU time (this process and its children, all reaped) and the wall clock:
  bare    `python -I -S -B -c pass`: the interpreter's start, a process per program's floor
  fresh   a zygote per program (Zygote(mode), one program, close): a sandbox built per program
  zygote  N programs through one zygote, one after another (a grading worker's steady state)
  batch   gmts.code_rewards on N generated problems and their solutions, all distinct, every core
and the ratios to bare. The programs are the cpu preset's (--task code --data easy): a one-line
function and three asserts. The numbers move with the machine's load: the sandbox mode and the
load average are printed with them.
"""
import argparse
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gmts  # noqa: E402


def cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def measure(fn, n: int) -> tuple:
    """(CPU s, wall s) per call of fn over n calls."""
    c, t = cpu(), time.perf_counter()
    for i in range(n):
        fn(i)
    return (cpu() - c) / n, (time.perf_counter() - t) / n


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=256, help="programs per measurement")
    n = p.parse_args().n
    mode = gmts.sandbox_mode()
    rows = gmts.load_rows("code", "easy", n, 7)
    codes = [f"# {i}\n{r['solution']}" for i, r in enumerate(rows)]  # distinct: none graded twice
    python = os.path.realpath(sys.executable)
    bare = [python, "-I", "-S", "-B", "-c", "pass"]
    results = {"bare": measure(lambda i: subprocess.run(bare), n)}

    def fresh(i):
        box = gmts.Zygote(mode)
        assert box.run(codes[i], rows[i]) is True
        box.close()
    results["fresh"] = measure(fresh, max(n // 4, 1))
    c, t = cpu(), time.perf_counter()  # the zygote's CPU counts once reaped: close() inside
    box = gmts.Zygote(mode)
    assert all(box.run(codes[i], rows[i]) is True for i in range(n))
    box.close()
    results["zygote"] = ((cpu() - c) / n, (time.perf_counter() - t) / n)
    texts = [f"```python\n{c}```" for c in codes]
    c, t = cpu(), time.perf_counter()
    assert gmts.code_rewards(texts, rows) == [1.0] * n
    results["batch"] = ((cpu() - c) / n, (time.perf_counter() - t) / n)
    workers = len(os.sched_getaffinity(0))
    print(f"sandbox mode {mode} | {workers} cores | load average {os.getloadavg()[0]:.2f} | "
          f"{n} programs")
    print("| per program | CPU ms | wall ms | CPU / bare |\n|---|---|---|---|")
    for name, (c, w) in results.items():
        print(f"| {name} | {1000 * c:.1f} | {1000 * w:.1f} | {c / results['bare'][0]:.2f} |")


if __name__ == "__main__":
    main()
