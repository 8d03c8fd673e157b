#!/usr/bin/env python3
"""The fine-tune workflow of docs/huggingface.md end to end, on a random Llama
made by transformers (the llama-tiny preset's shape) with a word-level
tokenizer of its own:

  1. scripts/tokenize.py turns text into train.bin + train.bin.json;
  2. train_gpt --init-from hf:DIR at dp 2 x tp 2 x pp 2 under ZeRO-2 trains
     20 steps (a checkpoint at step 16), --export-hf OUT, --consolidate;
  3. transformers' logits on OUT equal tessera's final model's (gpt_logits on
     the consolidated weights) within 1e-5 relative;
  4. the step-16 checkpoint resumed in the same layout continues bit for bit
     (losses of steps 17-20), and resumed at dp 4 x tp 2 within 1e-5;
  5. tessera_generate --model hf:OUT (greedy, at 2 ranks) draws the tokens
     transformers' generate() draws from OUT, and tokenize.py --decode
     turns them into the tokenizer's words.

usage: hf_finetune_check.py WORK_DIR TOKENIZE_PY TRAIN_GPT GPT_LOGITS GENERATE LAUNCHER...
"""
import json
import os
import shutil
import subprocess
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file

work, tokenize_py, train_gpt, gpt_logits, generate, launcher = sys.argv[1:6] + [sys.argv[6:]]
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
failures = []


def run(cmd):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        print(f"{' '.join(map(str, cmd))}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        sys.exit(1)
    return r.stdout


# A random Llama of llama-tiny's shape, every norm weight random.
model_dir = os.path.join(work, "llama")
config = transformers.LlamaConfig(
    vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, rms_norm_eps=1e-5,
    rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    bos_token_id=1, eos_token_id=2)
torch.manual_seed(5)
model = transformers.AutoModelForCausalLM.from_config(config)
with torch.no_grad():
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.copy_(1 + 0.3 * torch.randn_like(p))
model.save_pretrained(model_dir)

# Its tokenizer: one id per word of a 99-word vocabulary.
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(98)]
tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.save(os.path.join(model_dir, "tokenizer.json"))
g = torch.Generator().manual_seed(0)
with open(os.path.join(work, "corpus.jsonl"), "w") as f:
    for _ in range(400):
        n = int(torch.randint(20, 60, (1,), generator=g))
        # A learnable text: each word mostly follows its predecessor + 1.
        start = int(torch.randint(3, 90, (1,), generator=g))
        f.write(json.dumps({"text": " ".join(f"w{(start + i) % 98}" for i in range(n))}) + "\n")
print(run([sys.executable, tokenize_py, model_dir, os.path.join(work, "corpus.jsonl"),
           "--out", os.path.join(work, "train.bin")]).strip())
meta = json.load(open(os.path.join(work, "train.bin.json")))
if meta["dtype"] != "uint16" or meta["vocab_size"] != 101:
    failures.append(f"train.bin.json: {meta}, expected uint16 and the tokenizer's 101 ids")

common = ["--data", os.path.join(work, "train.bin"), "--seq", 16, "--batch", 8, "--steps", 20, "--lr", 3e-3,
          "--sample", 0, "--eval-every", 0, f"--init-from=hf:{model_dir}", "--spec", "zero2"]
layout_a = ["--dp", 2, "--tp", 2, "--pp", 2]
ckpt, out = os.path.join(work, "ckpt"), os.path.join(work, "export")
final = os.path.join(work, "final.safetensors")


def losses(path):
    return {r["step"]: r["loss"] for r in map(json.loads, open(path)) if r.get("kind", "train") == "train" and
            "loss" in r}


run(launcher + ["-np", 8, train_gpt] + common + layout_a +
    ["--save", ckpt, "--save-every", 16, "--export-hf", out, "--consolidate", final,
     "--metrics", os.path.join(work, "a.jsonl")])
first = losses(os.path.join(work, "a.jsonl"))
print(f"fine-tune at dp 2 x tp 2 x pp 2 (ZeRO-2): loss {first[1]:.4f} -> {first[20]:.4f}")
if not first[20] < first[1] - 0.2:
    failures.append(f"the fine-tune did not learn: loss {first[1]} -> {first[20]}")

# transformers on the export against tessera's final model.
ids = torch.randint(0, 101, (2, 16), generator=g)
save_file({"ids": ids}, os.path.join(work, "ids.safetensors"))
run(launcher + ["-np", 1, gpt_logits, "--preset", "llama-tiny", final, os.path.join(work, "ids.safetensors"),
                os.path.join(work, "tessera.safetensors")])
ours = load_file(os.path.join(work, "tessera.safetensors"))["logits"]
exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
with torch.no_grad():
    theirs = exported(ids).logits
e = ((ours - theirs).norm() / theirs.norm()).item()
print(f"transformers on the export vs tessera's final model: relative error {e:.2e}")
if not e <= 1e-5:
    failures.append(f"transformers' logits on the export differ from tessera's final model by {e:.2e}")

# Resume the step-16 checkpoint: the same layout bit for bit, another within 1e-5.
step16 = os.path.join(ckpt, "step-000016")
for name, layout, exact in (("dp 2 x tp 2 x pp 2", layout_a, True), ("dp 4 x tp 2", ["--dp", 4, "--tp", 2], False)):
    metrics = os.path.join(work, f"resume-{len(layout)}.jsonl")
    run(launcher + ["-np", 8, train_gpt] + common + layout + ["--resume", step16, "--metrics", metrics])
    again = losses(metrics)
    for step in range(17, 21):
        same = again[step] == first[step]
        close = abs(again[step] - first[step]) <= 1e-5 * abs(first[step])
        if (exact and not same) or not close:
            failures.append(f"resumed at {name}: step {step} loss {again[step]!r}, the uninterrupted run's "
                            f"{first[step]!r}")
    print(f"resumed at {name}: losses of steps 17-20 {[again[s] for s in range(17, 21)]} "
          f"(uninterrupted {[first[s] for s in range(17, 21)]})")

# Streamed generation from the exported directory against transformers' greedy generate().
prompt = [5, 6, 7, 8]
gen_file = os.path.join(work, "gen.json")
run(launcher + ["-np", 2, generate, "--model", f"hf:{out}", "--prompt", ",".join(map(str, prompt)), "--tokens", 8,
                "--temperature", 0, "--out", gen_file])
drawn = json.load(open(gen_file))["tokens"][0]
with torch.no_grad():
    expected = exported.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0].tolist()[len(prompt):]
if drawn != expected:
    failures.append(f"tessera_generate --model hf:{out} drew {drawn}, transformers' generate() {expected}")
text = run([sys.executable, tokenize_py, model_dir, "--decode", gen_file]).strip()
print(f"tessera_generate --model hf:export (tp 2, greedy): {drawn}, as transformers; decoded: {text!r}")
if text != " ".join(words[i] for i in drawn):
    failures.append(f"tokenize.py --decode {gen_file} printed {text!r}, not the words of {drawn}")

if failures:
    print("\n".join(["FAILED:"] + failures))
    sys.exit(1)
print("fine-tune round trip: tokenized, trained, exported, resumed")
