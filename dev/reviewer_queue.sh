#!/bin/bash
# The reviewers' runs (docs/results.md): one worker per call; start two to run two at a time, as the records did.
#   EXP=/path/for/exports PY=/path/to/venv/bin/python bash dev/reviewer_queue.sh &   (twice)
# The records ran on AVX2 kernels: on a CPU with AVX-512, export ATEN_CPU_CAPABILITY=avx2 first, or the runs part
# from the records (python -c "import torch; print(torch.backends.cpu.get_cpu_capability())" says which).
# Each worker claims the next unclaimed line of dev/reviewer_jobs.txt (a mkdir under $EXP/claims is atomic), runs
#   cd $EXP/SHA && OMP_NUM_THREADS=1 $PY gmts_lab.py compare ARGS --workers 1 --out out/reviewer/JOB
# from an export of commit SHA (made once, from this checkout), and repeats; it exits when every line is claimed.
# A job already in dev/reviewer_runs.jsonl is skipped: a later session goes on where the last one stopped.
# A run stopped midway leaves a claim and an unfinished folder: delete both to run it again.
# Then: python dev/reviewer_runs.py --add $EXP/SHA/out/reviewer --commit SHA, once per SHA (on the machine that ran them).
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
EXP=${EXP:-$REPO/../exp}
PY=${PY:-python}
JOBS=${JOBS:-$REPO/dev/reviewer_jobs.txt}
mkdir -p "$EXP/claims"
while read -r sha job args; do
  case "$sha" in ''|\#*) continue;; esac
  grep -q "\"job\": \"$job\"" "$REPO/dev/reviewer_runs.jsonl" 2>/dev/null && continue  # recorded already
  mkdir "$EXP/claims/$job" 2>/dev/null || continue
  (  # one worker makes the export; the other waits for it
    flock 9
    if [ ! -d "$EXP/$sha" ]; then
      rm -rf "$EXP/$sha.tmp" && mkdir -p "$EXP/$sha.tmp" &&
        git -C "$REPO" archive "$sha" | tar -x -C "$EXP/$sha.tmp" && mv "$EXP/$sha.tmp" "$EXP/$sha"
    fi
  ) 9>"$EXP/export.lock"
  echo "$(date -u +%H:%M:%S) start $job" >> "$EXP/log.txt"
  (cd "$EXP/$sha" && OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $PY gmts_lab.py compare $args --workers 1 \
      --out "out/reviewer/$job") > "$EXP/claims/$job/stdout" 2>&1
  echo "$(date -u +%H:%M:%S) end $job rc=$?" >> "$EXP/log.txt"
done < "$JOBS"
