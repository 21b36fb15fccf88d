"""GPU check helper: TRL's GRPOTrainer step on the model of bench_gmts' `step`, in its own process
(a device-side assert poisons the CUDA context, so it cannot share one with the rest).
  python dev/gpu_trl_probe.py bf16|fp32   (fp32: master weights under TRL's bf16 autocast)"""
import copy
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

import bench_gmts as B  # noqa: E402
import gmts  # noqa: E402

mode = sys.argv[1]
# PROBE_DEVICE=cpu: a smoke of this script, with a tiny config
dev = torch.device(os.environ.get("PROBE_DEVICE", "cuda"))
tiny = dev.type != "cuda"
cfg = gmts.Config(**(dict(prompts_per_step=2, group_size=2, max_new_tokens=8) if tiny else {}))
torch.manual_seed(0)
with torch.device(dev):
    model = Qwen2ForCausalLM(Qwen2Config(**(B.SMALL if tiny else B.QWEN05), eos_token_id=151645,
                                         pad_token_id=151643, bos_token_id=None))
tok = gmts.build_tiny()[1]
prompts = B.text_prompts(cfg.prompts_per_step, 64, seed=0)
tok.padding_side = "left"
enc = tok(prompts, return_tensors="pt", padding=True).to(dev)
with torch.no_grad():
    logits = B.bf16_copy(model)(**enc).logits
print("bf16 copy forward: rows with a NaN logit per prompt",
      torch.isnan(logits).any(-1).sum(1).tolist(), "last position NaN",
      bool(torch.isnan(logits[:, -1]).any()), flush=True)
if mode == "fp32":
    B.bf16_copy = lambda m: copy.deepcopy(m).train()
out = B.trl_step(model, tok, prompts, cfg, dev, 4)
print(json.dumps(dict(mode=mode, **out)))
