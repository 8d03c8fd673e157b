#!/usr/bin/env python3
"""Hugging Face directories in and out of tessera, against transformers itself
(docs/huggingface.md), for one architecture:

  import  a random model made by transformers (every norm weight and bias
          random), saved fp32 single-file, fp32 sharded and bf16: tessera's
          logits (hf_logits, loaded straight from the directory) equal
          transformers' within 1e-5 relative at 1 rank and at dp 2 x tp 2 x
          pp 2 (8 ranks);
  export  train_gpt --init-from hf:DIR with a zero learning rate (the
          sharded one at dp 2 x tp 2 x pp 2, bf16 at tp 2), --export-hf OUT: transformers loads OUT with no
          missing or unexpected keys and no warning, and its logits equal the
          original's bit for bit (fp32; bf16 exported as bf16 too);
  refuse  (llama) token data with an id beyond the vocabulary, a missing
          shard, a truncated file, offsets beyond the file, a tensor of the
          wrong shape, a config key tessera does not carry out, an unknown
          architecture: a non-zero exit and the message on every rank.

usage: hf_checkpoint_check.py ARCH WORK_DIR TRAIN_GPT HF_LOGITS LAUNCHER...
  ARCH: gpt2, llama, mistral, qwen2, qwen3, mixtral, qwen2_moe; LAUNCHER: mpiexec and
  its flags (-np N is appended).
"""
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import torch
import transformers
from safetensors.torch import save_file

TOLERANCE = 1e-5
arch, work, train_gpt, hf_logits, launcher = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
failures = []

COMMON = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(vocab_size=101, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                            bos_token_id=None, eos_token_id=None),
    "llama": lambda: transformers.LlamaConfig(rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, **COMMON),
    "mistral": lambda: transformers.MistralConfig(rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None, **COMMON),
    "qwen2": lambda: transformers.Qwen2Config(rms_norm_eps=1e-6, rope_theta=10000.0, use_sliding_window=False,
                                              **COMMON),
    "qwen3": lambda: transformers.Qwen3Config(rms_norm_eps=1e-6, rope_theta=10000.0, head_dim=16, **COMMON),
    "mixtral": lambda: transformers.MixtralConfig(rms_norm_eps=1e-5, rope_theta=10000.0, num_local_experts=4,
                                                  num_experts_per_tok=2, sliding_window=None, **COMMON),
    # Fine-grained experts at top 3, not renormalized, beside a gated shared expert.
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(rms_norm_eps=1e-6, rope_theta=10000.0, use_sliding_window=False,
                                                     num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
                                                     shared_expert_intermediate_size=40, norm_topk_prob=False,
                                                     **COMMON),
}
SEQ, BATCH = 16, 4


def run(np_, *args, expect_ok=True):
    cmd = launcher + ["-np", str(np_)] + [str(a) for a in args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if expect_ok and r.returncode != 0:
        failures.append(f"{' '.join(cmd)}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return r


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def make_model(path, dtype, shard):
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch]())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm weights and biases: random, so that a swapped or dropped one shows
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in name or "ln_" in name else 0.0))
    model.to(dtype).save_pretrained(path, max_shard_size=shard)
    return model


def hf_forward(path, ids):
    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return m(ids).logits


def tessera_logits(path, ids, np_, dp, tp, pp, tag):
    from safetensors.torch import load_file
    ids_file = os.path.join(work, "ids.safetensors")
    save_file({"ids": ids.to(torch.int64)}, ids_file)
    out = os.path.join(work, f"logits-{tag}")
    r = run(np_, hf_logits, path, ids_file, out, "--dp", dp, "--tp", tp, "--pp", pp)
    if r.returncode != 0:
        return None
    print(r.stdout.strip())
    return torch.cat([load_file(f"{out}.dp{k}.safetensors")["logits"] for k in range(dp)])


ids = torch.randint(0, 101, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
# Token data for train_gpt: uint16 ids below the vocabulary, with the metadata tokenize.py writes.
data = os.path.join(work, "tokens.bin")
np.random.RandomState(0).randint(0, 101, size=20000).astype(np.uint16).tofile(data)
json.dump({"dtype": "uint16", "vocab_size": 101}, open(data + ".json", "w"))

variants = [("fp32", torch.float32, "5GB"), ("fp32-sharded", torch.float32, "20KB"), ("bf16", torch.bfloat16, "5GB")]
for tag, dtype, shard in variants:
    path = os.path.join(work, f"{arch}-{tag}")
    make_model(path, dtype, shard)
    sharded = os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    if tag.endswith("sharded") and not sharded:
        failures.append(f"{path}: save_pretrained wrote one file, the test needs shards")
    reference = hf_forward(path, ids)
    layouts = [(1, 1, 1, 1), (8, 2, 2, 2)]
    for np_, dp, tp, pp in layouts:
        got = tessera_logits(path, ids, np_, dp, tp, pp, f"{tag}-{np_}")
        if got is None:
            continue
        e = rel(got, reference)
        print(f"{arch} {tag} at {np_} rank(s) (dp {dp} tp {tp} pp {pp}): relative error {e:.2e}")
        if not e <= TOLERANCE:
            failures.append(f"{arch} {tag} at {np_} ranks: logits differ from transformers' by {e:.2e}")

    # Export: through train_gpt (the sharded one at 8 ranks, bf16 at tp 2), weights unchanged (lr 0), then
    # transformers on the export.
    if tag == "fp32":
        continue
    out = os.path.join(work, f"{arch}-{tag}-export")
    export_dtype = "bfloat16" if dtype == torch.bfloat16 else "float32"
    layout = ["--dp", 2, "--tp", 2, "--pp", 2] if tag == "fp32-sharded" else ["--tp", 2]
    r = run(8 if tag == "fp32-sharded" else 2, train_gpt, f"--init-from=hf:{path}", *layout,
            "--steps", 1, "--lr", 0, "--weight-decay", 0, "--data", data, "--seq", SEQ, "--batch", 8,
            "--sample", 0, "--eval-every", 0, "--export-hf", out, "--export-dtype", export_dtype,
            "--export-shard-mb", 1)
    if r.returncode != 0:
        continue
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    transformers.utils.logging.get_logger().addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exported, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True,
                                                                           dtype=torch.float32)
    transformers.utils.logging.get_logger().removeHandler(handler)
    problems = {k: v for k, v in info.items() if v}
    said = [str(w.message) for w in caught] + [line for line in stream.getvalue().splitlines() if line.strip()]
    if problems or said:
        failures.append(f"{out}: transformers loaded it with {problems} and said {said}")
    stored = json.load(open(os.path.join(out, "config.json")))
    if stored.get("dtype") != export_dtype:
        failures.append(f"{out}/config.json: dtype {stored.get('dtype')}, exported as {export_dtype}")
    with torch.no_grad():
        again = exported(ids).logits
    if not torch.equal(again, reference):
        failures.append(f"{arch} {tag}: transformers' logits on the export differ from the original's by "
                        f"{(again - reference).abs().max().item():.3e} (must be bit for bit)")
    else:
        print(f"{arch} {tag}: exported ({' '.join(map(str, layout))}) as {export_dtype}, transformers' logits equal "
              "bit for bit")

# Refusals, at 2 ranks (one architecture: the paths are shared): every rank names the problem, the job
# exits non-zero.
base = os.path.join(work, f"{arch}-fp32-sharded")
if arch != "llama":
    if failures:
        print("\n".join(["FAILED:"] + failures))
        sys.exit(1)
    print(f"{arch}: import and export agree with transformers")
    sys.exit(0)


def refused(what, path, expect, data_file=data):
    r = run(2, train_gpt, f"--init-from=hf:{path}", "--tp", 2, "--steps", 1, "--data",
            data_file, "--seq", SEQ, "--batch", BATCH, "--sample", 0, "--eval-every", 0, expect_ok=False)
    text = r.stdout + r.stderr
    if r.returncode == 0 or expect not in text or "Traceback" in text or "Segmentation" in text:
        failures.append(f"{what}: exit {r.returncode}, expected a refusal naming '{expect}'; got:\n{text[-2000:]}")
    else:
        print(f"refused as expected ({what}): {[l for l in text.splitlines() if expect in l][0][:200]}")


def variant(name, change):
    path = os.path.join(work, f"bad-{name}")
    shutil.copytree(base, path)
    change(path)
    return path


index = json.load(open(os.path.join(base, "model.safetensors.index.json")))
first_file = sorted(set(index["weight_map"].values()))[0]
refused("a missing shard", variant("missing", lambda p: os.remove(os.path.join(p, first_file))), "is missing")


def truncate(p):
    f = os.path.join(p, first_file)
    os.truncate(f, os.path.getsize(f) - 7)


refused("a truncated file", variant("truncated", truncate), "lies outside the file")


def overrun(p):
    f = os.path.join(p, first_file)
    blob = open(f, "rb").read()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 10 ** 9
    text = json.dumps(header).encode()
    open(f, "wb").write(len(text).to_bytes(8, "little") + text + blob[8 + n:])


refused("offsets beyond the file", variant("overrun", overrun), "lies outside the file")


def wrong_shape(p):
    c = json.load(open(os.path.join(p, "config.json")))
    key = "n_embd" if arch == "gpt2" else "intermediate_size"
    c[key] = c[key] * 2
    json.dump(c, open(os.path.join(p, "config.json"), "w"))


refused("a tensor of the wrong shape", variant("shape", wrong_shape), "has shape")


def unknown_key(p):
    c = json.load(open(os.path.join(p, "config.json")))
    c["quantization_config"] = {"bits": 4}
    json.dump(c, open(os.path.join(p, "config.json"), "w"))


refused("a config key not carried out", variant("key", unknown_key), "quantization_config")


def unknown_arch(p):
    c = json.load(open(os.path.join(p, "config.json")))
    c["architectures"] = ["FalconForCausalLM"]
    json.dump(c, open(os.path.join(p, "config.json"), "w"))


refused("an unknown architecture", variant("arch", unknown_arch), "FalconForCausalLM")
big = os.path.join(work, "big.bin")
np.full(20000, 150, dtype=np.uint16).tofile(big)
refused("token ids beyond the vocabulary", base, "needs a vocabulary of 151", big)

if failures:
    print("\n".join(["FAILED:"] + failures))
    sys.exit(1)
print(f"{arch}: import, export and refusals agree with transformers")
