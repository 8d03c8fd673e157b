#!/usr/bin/env python3
"""tessera's Llama family against Hugging Face transformers' own models:
for each of LlamaForCausalLM (Llama 3 rope scaling), MistralForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM and MixtralForCausalLM, built from a small
config matching a tessera test preset, with every tensor random (norm weights
!= 1, biases != 0), the weights are renamed to tessera's full-state names
(Note [GPT full weights]), gpt_logits runs tessera's model on them, and the
logits and the loss for fixed token ids must agree within 1e-5 relative
(||tessera - hf|| / ||hf||) in fp32.

usage: hf_models_check.py WORK_DIR GPT_LOGITS_COMMAND...
"""
import os
import shutil
import subprocess
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file

TOLERANCE = 1e-5
work, gpt_logits = sys.argv[1], sys.argv[2:]
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)

# The tessera test presets' shapes (GPTConfig::preset "*-tiny").
COMMON = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
MODELS = [
    ("llama-tiny", transformers.LlamaConfig(rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, **COMMON)),
    ("mistral-tiny", transformers.MistralConfig(rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None, **COMMON)),
    ("qwen2-tiny", transformers.Qwen2Config(rms_norm_eps=1e-6, rope_theta=10000.0, use_sliding_window=False, **COMMON)),
    ("qwen3-tiny", transformers.Qwen3Config(rms_norm_eps=1e-6, rope_theta=10000.0, head_dim=16, **COMMON)),
    ("mixtral-tiny", transformers.MixtralConfig(rms_norm_eps=1e-5, rope_theta=10000.0, num_local_experts=4,
                                                num_experts_per_tok=2, sliding_window=None, **COMMON)),
]


def to_tessera(hf, cfg):
    """Hugging Face's names and layouts -> tessera's: q/k/v per head (fused
    c_attn) or k/v per kv head (kv_proj), gate/up/down as c_gate/c_fc/c_proj,
    experts stacked (transformers 5 stores them fused: gate_up_proj)."""
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    t = {"wte.weight": hf.pop("model.embed_tokens.weight"), "ln_f.weight": hf.pop("model.norm.weight"),
         "lm_head.weight": hf.pop("lm_head.weight")}
    for i in range(cfg.num_hidden_layers):
        h, p = f"model.layers.{i}.", f"h.{i}."
        t[p + "ln_1.weight"] = hf.pop(h + "input_layernorm.weight")
        t[p + "ln_2.weight"] = hf.pop(h + "post_attention_layernorm.weight")
        t[p + "attn.c_proj.weight"] = hf.pop(h + "self_attn.o_proj.weight")
        for kind in ("weight", "bias"):
            if h + f"self_attn.q_proj.{kind}" not in hf:
                continue
            q, k, v = (hf.pop(h + f"self_attn.{x}_proj.{kind}") for x in "qkv")
            per_head = lambda x, n: x.reshape(n, d, *x.shape[1:])
            if kv == heads:
                t[p + f"attn.c_attn.{kind}"] = torch.stack([per_head(q, heads), per_head(k, heads),
                                                            per_head(v, heads)], 1).flatten(0, 2)
            else:
                t[p + f"attn.q_proj.{kind}"] = q
                t[p + f"attn.kv_proj.{kind}"] = torch.stack([per_head(k, kv), per_head(v, kv)], 1).flatten(0, 2)
        for x in ("q_norm", "k_norm"):
            if h + f"self_attn.{x}.weight" in hf:
                t[p + f"attn.{x}.weight"] = hf.pop(h + f"self_attn.{x}.weight")
        if h + "mlp.experts.gate_up_proj" in hf:  # transformers 5
            gate_up = hf.pop(h + "mlp.experts.gate_up_proj")
            f = gate_up.shape[1] // 2
            t[p + "mlp.router.weight"] = hf.pop(h + "mlp.gate.weight")
            t[p + "mlp.c_gate.weight"], t[p + "mlp.c_fc.weight"] = gate_up[:, :f], gate_up[:, f:]
            t[p + "mlp.c_proj.weight"] = hf.pop(h + "mlp.experts.down_proj")
        elif h + "block_sparse_moe.gate.weight" in hf:  # transformers 4
            e = range(cfg.num_local_experts)
            t[p + "mlp.router.weight"] = hf.pop(h + "block_sparse_moe.gate.weight")
            for ours, theirs in (("c_gate", "w1"), ("c_fc", "w3"), ("c_proj", "w2")):
                t[p + f"mlp.{ours}.weight"] = torch.stack(
                    [hf.pop(h + f"block_sparse_moe.experts.{j}.{theirs}.weight") for j in e])
        else:
            for ours, theirs in (("c_gate", "gate"), ("c_fc", "up"), ("c_proj", "down")):
                t[p + f"mlp.{ours}.weight"] = hf.pop(h + f"mlp.{theirs}_proj.weight")
    if hf:
        sys.exit(f"FAILED: Hugging Face tensors without a tessera name: {sorted(hf)}")
    return {k: v.contiguous() for k, v in t.items()}


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


failed = False
gen = torch.Generator().manual_seed(3)
ids = torch.randint(0, 101, (2, 16), generator=gen)
targets = torch.randint(0, 101, (2, 16), generator=gen)
save_file({"ids": ids}, os.path.join(work, "ids.safetensors"))
for preset, cfg in MODELS:
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
        hf_logits = model(ids).logits.float()
    weights = os.path.join(work, preset + ".safetensors")
    out = os.path.join(work, preset + ".logits.safetensors")
    save_file(to_tessera({k: v.clone() for k, v in model.state_dict().items()}, cfg), weights)
    result = subprocess.run(gpt_logits + ["--preset", preset, weights, os.path.join(work, "ids.safetensors"), out],
                            capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"FAILED: gpt_logits for {preset} (exit {result.returncode})\n{result.stdout}{result.stderr}")
    ours = load_file(out)["logits"]
    loss = lambda x: torch.nn.functional.cross_entropy(x.reshape(-1, x.shape[-1]), targets.reshape(-1))
    e_logits, e_loss = rel(ours, hf_logits), rel(loss(ours), loss(hf_logits))
    ok = e_logits <= TOLERANCE and e_loss <= TOLERANCE
    failed = failed or not ok
    print(f"{'ok' if ok else 'FAILED'} {type(model).__name__} ({preset}): logits relative error {e_logits:.2e}, "
          f"loss {loss(hf_logits).item():.6f} relative error {e_loss:.2e}")
sys.exit(1 if failed else 0)
