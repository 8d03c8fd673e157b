#!/usr/bin/env python3
"""Exports a consolidated tessera GPT (tessera_consolidate or train_gpt
--consolidate) as a Hugging Face GPT-2 directory: model.safetensors under
GPT-2's names and layouts plus config.json, which
transformers.GPT2LMHeadModel.from_pretrained(OUT_DIR) loads as it is
(docs/checkpoints.md, "Hugging Face export").

usage: export_hf_gpt2.py MODEL.safetensors OUT_DIR --heads N [--dropout P]
Needs torch and safetensors (transformers only to load the result).
"""
import argparse
import json
import os
import sys

EPILOG = """The file does not record the number of attention heads, and c_attn's
rows are grouped per head: pass the --heads the model was trained with.
Refused: mixture-of-experts models (GPT-2 has no experts) and files that are
not a tessera GPT."""

# tessera's GPT: at::gelu (erf, Hugging Face's "gelu"), torch LayerNorm eps 1e-5,
# biases on every Linear, no bias on the LM head.
BLOCK = ["ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
         "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
         "mlp.c_proj.weight", "mlp.c_proj.bias"]
LINEAR_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def fail(message):
    sys.exit(f"export_hf_gpt2: error: {message}")


def read(path):
    if not os.path.isfile(path):
        fail(f"{path} does not exist (expected the .safetensors file of tessera_consolidate)")
    try:
        import torch  # noqa: F401  (safetensors' "pt" framework)
        from safetensors import safe_open
    except ImportError as e:
        fail(f"needs torch and safetensors ({e}); pip install torch safetensors")

    try:
        with safe_open(path, framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # safetensors raises its own error type per version
        fail(f"{path} is not a readable safetensors file: {e}")


def convert(src, heads, path):
    if "wte.weight" not in src or "wpe.weight" not in src:
        fail(f"{path} is not a consolidated tessera GPT: no wte.weight / wpe.weight (names: {sorted(src)[:8]} ...)")
    if any(".mlp.router." in n or (".mlp.c_fc.weight" in n and src[n].dim() == 3) for n in src):
        fail(f"{path} has mixture-of-experts blocks, which GPT-2 cannot express")
    if src["wte.weight"].dim() != 2:
        fail(f"{path}: wte.weight has shape {list(src['wte.weight'].shape)}, expected [vocab, hidden]")
    vocab, hidden = src["wte.weight"].shape
    context = src["wpe.weight"].shape[0]
    layers = 0
    while f"h.{layers}.ln_1.weight" in src:
        layers += 1
    if layers == 0:
        fail(f"{path} has no transformer blocks (h.0.ln_1.weight ...)")
    if heads < 1 or hidden % heads:
        fail(f"--heads {heads} does not divide the hidden size {hidden}")
    tied = "lm_head.weight" not in src
    expected = {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"}
    expected |= {f"h.{i}.{p}" for i in range(layers) for p in BLOCK}
    if not tied:
        expected.add("lm_head.weight")
    missing, extra = sorted(expected - set(src)), sorted(set(src) - expected)
    if missing or extra:
        fail(f"{path} is not a tessera GPT of {layers} layers: missing {missing}, unexpected {extra}")
    ffn = src["h.0.mlp.c_fc.weight"].shape[0]
    shapes = {"wpe.weight": (context, hidden), "ln_f.weight": (hidden,), "ln_f.bias": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    per_block = {"attn.c_attn.weight": (3 * hidden, hidden), "attn.c_attn.bias": (3 * hidden,),
                 "attn.c_proj.weight": (hidden, hidden), "mlp.c_fc.weight": (ffn, hidden), "mlp.c_fc.bias": (ffn,),
                 "mlp.c_proj.weight": (hidden, ffn)}
    for i in range(layers):
        shapes.update({f"h.{i}.{p}": per_block.get(p, (hidden,)) for p in BLOCK})
    for name, t in src.items():
        if name in shapes and tuple(t.shape) != shapes[name]:
            fail(f"{path}: {name} has shape {list(t.shape)}, expected {list(shapes[name])}")
        if not t.is_floating_point():
            fail(f"{path}: {name} has dtype {t.dtype}, expected a floating-point type")

    head_dim = hidden // heads
    out = {"transformer.wte.weight": src["wte.weight"], "transformer.wpe.weight": src["wpe.weight"],
           "transformer.ln_f.weight": src["ln_f.weight"], "transformer.ln_f.bias": src["ln_f.bias"]}
    if not tied:
        out["lm_head.weight"] = src["lm_head.weight"]
    for i in range(layers):
        for p in BLOCK:
            t = src[f"h.{i}.{p}"]
            if p.startswith("attn.c_attn."):
                # tessera: [head][q|k|v][head_dim] (whole heads per tensor shard);
                # Hugging Face: [q|k|v][head][head_dim].
                t = t.reshape(heads, 3, head_dim, -1).transpose(0, 1).reshape(t.shape)
            if p in LINEAR_WEIGHTS:
                t = t.t()  # torch Linear [out, in] -> Conv1D [in, out]
            out[f"transformer.h.{i}.{p}"] = t.contiguous()
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab,
              "n_positions": context, "n_embd": hidden, "n_layer": layers, "n_head": heads, "n_inner": ffn,
              "activation_function": "gelu", "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
              "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
              "reorder_and_upcast_attn": False, "tie_word_embeddings": tied, "use_cache": True,
              # 50256 is GPT-2's <|endoftext|>; a smaller (byte-level) vocabulary has none.
              "bos_token_id": 50256 if vocab > 50256 else None, "eos_token_id": 50256 if vocab > 50256 else None}
    return out, config


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", metavar="MODEL.safetensors", help="consolidated tessera GPT")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="directory to write (created if absent)")
    parser.add_argument("--heads", type=int, required=True, help="attention heads of the model (train_gpt --heads)")
    parser.add_argument("--dropout", type=float, default=0.0, help="embd/attn/resid dropout in config.json (default 0)")
    args = parser.parse_args()

    tensors, config = convert(read(args.model), args.heads, args.model)
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
        config[key] = args.dropout
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        fail(f"{args.out_dir} exists and is not a directory")
    os.makedirs(args.out_dir, exist_ok=True)
    from safetensors.torch import save_file

    weights = os.path.join(args.out_dir, "model.safetensors")
    save_file(tensors, weights, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(weights, 0o666 & ~umask)  # safetensors writes it 0600
    with open(os.path.join(args.out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    print(f"{args.out_dir}: GPT-2 with {config['n_layer']} layers, {args.heads} heads, hidden {config['n_embd']}, "
          f"vocab {config['vocab_size']}, context {config['n_positions']}, "
          f"{'tied' if config['tie_word_embeddings'] else 'untied'} head, from {args.model}")


if __name__ == "__main__":
    main()
