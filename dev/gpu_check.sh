# The GPU check (dev/LOG.md, "The GPU check") in one device call, from the repo root; results under $OUT.
# Wheels first, on the CPU machine, into the ignored .whl (dev/LOG.md, "The GPU check"); carry .whl.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, trl, datasets
print(torch.__version__, transformers.__version__, trl.__version__, datasets.__version__)"
s=$(date +%s)
for c in rollout step; do  # TRL's step runs in its own process below
  timeout 150 python3 bench_gmts.py $c --device cuda --trl-steps 0 --json $OUT/$c.json \
      > $OUT/$c.log 2>&1
  echo "bench $c rc=$? $(( $(date +%s) - s )) s"
  grep -v "Warning\|warnings.warn" $OUT/$c.log | tail -12
  s=$(date +%s)
done
s=$(date +%s)
timeout 170 python3 gmts.py --preset cpu --device cuda --steps 20 --eval-every 10 --save-every 0 \
    --out /tmp/run > $OUT/train.log 2>&1
echo "train rc=$? $(( $(date +%s) - s )) s"
tail -3 $OUT/train.log
for m in bf16 fp32; do  # TRL in its own process: a device-side assert poisons the CUDA context
  s=$(date +%s)
  CUDA_LAUNCH_BLOCKING=1 timeout 110 python3 dev/gpu_trl_probe.py $m > $OUT/trl_$m.log 2>&1
  echo "trl $m rc=$? $(( $(date +%s) - s )) s"
  grep -v "Warning\|warnings.warn" $OUT/trl_$m.log | grep -i "nan\|step_ms\|Error\|Assert" | tail -4
done
