#!/usr/bin/env python3
"""The Hugging Face export against tessera itself: exports MODEL with
scripts/export_hf_gpt2.py, loads it with transformers.GPT2LMHeadModel
(no missing, unexpected or mismatched keys, no warning logged), and compares
its logits for fixed token ids with those of tessera's C++ GPT (gpt_logits)
on the same file: max |difference| <= 1e-5 in fp32. Then the exporter's
refusals of bad input.

usage: hf_export_check.py EXPORTER WORK_DIR HEADS MODEL.safetensors|--random GPT_LOGITS_COMMAND...
  --random: gpt_logits writes the model (untied, every tensor random; HEADS must be 4)
"""
import logging
import os
import shutil
import subprocess
import sys
import warnings

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

TOLERANCE = 1e-5

exporter, work, heads, model = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
gpt_logits = sys.argv[5:]
shutil.rmtree(work, ignore_errors=True)  # nothing left from an earlier run
os.makedirs(work)


def run(cmd):
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)} (exit {result.returncode})\n{result.stdout}{result.stderr}")
    if result.stdout.strip():
        print(result.stdout.strip())


if model == "--random":
    model = os.path.join(work, "random_gpt.safetensors")
    run(gpt_logits + ["--random", model])
hf_dir = os.path.join(work, "hf")
run([sys.executable, exporter, model, hf_dir, "--heads", heads])

# Two rows over the whole context, ids from a fixed generator.
with safe_open(model, framework="pt") as f:
    vocab, context = f.get_slice("wte.weight").get_shape()[0], f.get_slice("wpe.weight").get_shape()[0]
ids = torch.randint(vocab, (2, context), generator=torch.Generator().manual_seed(5))
ids_file, logits_file = os.path.join(work, "ids.safetensors"), os.path.join(work, "tessera_logits.safetensors")
save_file({"ids": ids}, ids_file)
run(gpt_logits + [model, heads, ids_file, logits_file])
with safe_open(logits_file, framework="pt") as f:
    expected = f.get_tensor("logits")

# Everything transformers logs at WARNING or above, and every Python warning, fails the test.
logged = []
handler = logging.Handler(logging.WARNING)
handler.emit = lambda record: logged.append(record.getMessage())
logging.getLogger("transformers").addHandler(handler)
transformers.logging.set_verbosity_warning()
transformers.logging.disable_progress_bar()
failures = []
for attention in ("eager", "sdpa"):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            hf, info = transformers.GPT2LMHeadModel.from_pretrained(
                hf_dir, output_loading_info=True, attn_implementation=attention)
        except Exception as e:  # e.g. a weight of the wrong shape
            failures.append(f"{attention}: from_pretrained failed: {e}")
            continue
    problems = {k: sorted(v) for k, v in info.items() if v}
    if problems:
        failures.append(f"{attention}: from_pretrained reported {problems}")
    for w in caught:
        logged.append(f"{w.category.__name__}: {w.message}")
    hf.eval()
    with torch.no_grad():
        logits = hf(ids).logits
    if logits.dtype != torch.float32 or logits.shape != expected.shape:
        failures.append(f"{attention}: logits {logits.dtype} {list(logits.shape)}, tessera's {list(expected.shape)}")
        continue
    diff = (logits - expected).abs().max().item()
    print(f"{attention}: max |HF - tessera| logit = {diff:.3g} over {list(logits.shape)} "
          f"(logits up to {expected.abs().max().item():.3g}), tolerance {TOLERANCE:g}")
    if not diff <= TOLERANCE:
        failures.append(f"{attention}: max |HF - tessera| = {diff:.3g} > {TOLERANCE:g}")
if logged:
    failures.append("warnings from transformers: " + " | ".join(logged))

# Bad input: a clear error, no directory written.
garbage = os.path.join(work, "not_safetensors.bin")
with open(garbage, "wb") as f:
    f.write(b"\xff" * 64)
stray = os.path.join(work, "stray.safetensors")
save_file({"weight": torch.zeros(2, 2)}, stray)
moe = os.path.join(work, "moe.safetensors")
save_file({"wte.weight": torch.zeros(5, 4), "wpe.weight": torch.zeros(3, 4),
           "h.0.mlp.router.weight": torch.zeros(2, 4)}, moe)
bad = [([os.path.join(work, "nonexistent.safetensors"), "--heads", heads], "does not exist"),
       ([garbage, "--heads", heads], "is not a readable safetensors file"),
       ([stray, "--heads", heads], "is not a consolidated tessera GPT"),
       ([moe, "--heads", heads], "mixture-of-experts"),
       ([model, "--heads", "7"], "does not divide the hidden size"),
       ([model], "--heads")]
for args, message in bad:
    out = os.path.join(work, "refused")
    result = subprocess.run([sys.executable, exporter] + args + [out], capture_output=True, text=True)
    if result.returncode == 0 or message not in result.stderr or os.path.exists(out):
        failures.append(f"export_hf_gpt2 {' '.join(args)}: exit {result.returncode}, expected an error "
                        f"with '{message}': {result.stderr.strip()}")

if failures:
    sys.exit("FAILED:\n  " + "\n  ".join(failures))
print(f"{model}: the Hugging Face export loads without warnings and gives tessera's logits")
