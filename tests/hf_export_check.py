#!/usr/bin/env python3
"""A tessera checkpoint that was not imported (train_gpt_smoke's: GPT-2
shapes, byte vocabulary, tied head, exact GELU, trained at dp 2 x tp 2 under
ZeRO-3) exported by tessera_export_hf at 2 ranks: transformers loads the
directory with no missing or unexpected key and no warning, as the
architecture tessera chose (GPT2LMHeadModel), and its logits equal tessera's
own for the checkpoint (gpt_logits --checkpoint) within 1e-5 relative.

usage: hf_export_check.py WORK_DIR CHECKPOINT EXPORT_COMMAND GPT_LOGITS LAUNCHER...
"""
import io
import logging
import os
import shutil
import subprocess
import sys
import warnings

import torch
import transformers
from safetensors.torch import load_file, save_file

work, checkpoint, exporter, gpt_logits, launcher = sys.argv[1:5] + [sys.argv[5:]]
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)


def run(cmd):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r.stdout


out = os.path.join(work, "hf")
print(run(launcher + ["-np", 2, exporter, checkpoint, out]).strip())
ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
save_file({"ids": ids}, os.path.join(work, "ids.safetensors"))
run(launcher + ["-np", 1, gpt_logits, "--checkpoint", checkpoint, os.path.join(work, "ids.safetensors"),
                os.path.join(work, "tessera.safetensors")])
ours = load_file(os.path.join(work, "tessera.safetensors"))["logits"]
stream = io.StringIO()
transformers.utils.logging.get_logger().addHandler(logging.StreamHandler(stream))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
said = [str(w.message) for w in caught] + [l for l in stream.getvalue().splitlines() if l.strip()]
problems = {k: v for k, v in info.items() if v}
with torch.no_grad():
    theirs = model(ids).logits
e = ((ours - theirs).norm() / theirs.norm()).item()
print(f"{type(model).__name__} from {checkpoint}: relative error {e:.2e}, loading info {problems}, said {said}")
if problems or said or not e <= 1e-5 or type(model).__name__ != "GPT2LMHeadModel":
    sys.exit("FAILED")
