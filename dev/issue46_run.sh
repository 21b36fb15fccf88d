#!/bin/bash
# Issue 46's run queue: one worker per call; start two for the two-at-a-time runs of the rule (NOTES.md).
#   EXP=/path/for/exports PY=/path/to/venv/bin/python bash dev/issue46_run.sh &   (twice)
# Each worker claims the next unclaimed line of dev/issue46_jobs.txt (a mkdir under $EXP/claims is atomic), runs
#   cd $EXP/SHA && OMP_NUM_THREADS=1 $PY gmts_lab.py compare ARGS --workers 1 --out out/i46/JOB
# from an export of commit SHA (made once, from this checkout), and repeats; it exits when every line is claimed.
# A job already in dev/issue46_runs.jsonl is skipped: a later session goes on where the last one stopped.
# A run stopped midway leaves a claim and an unfinished folder: delete both to run it again.
# Then: python dev/issue46.py --add $EXP/SHA/out/i46 --commit SHA, once per SHA.
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
EXP=${EXP:-$REPO/../exp}
PY=${PY:-python}
JOBS=${JOBS:-$REPO/dev/issue46_jobs.txt}
mkdir -p "$EXP/claims"
while read -r sha job args; do
  case "$sha" in ''|\#*) continue;; esac
  grep -q "\"job\": \"$job\"" "$REPO/dev/issue46_runs.jsonl" 2>/dev/null && continue  # recorded already
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
      --out "out/i46/$job") > "$EXP/claims/$job/stdout" 2>&1
  echo "$(date -u +%H:%M:%S) end $job rc=$?" >> "$EXP/log.txt"
done < "$JOBS"
