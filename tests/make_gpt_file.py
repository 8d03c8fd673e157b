#!/usr/bin/env python3
"""make_gpt_file.py OUT LAYERS HIDDEN HEADS VOCAB CONTEXT

A GPT-2-shaped safetensors file with tessera's names (Note [GPT full
weights]) and every weight a small constant, written with the standard
library only: for tests that need weights larger than a memory budget and
care about memory, not values."""
import array
import json
import struct
import sys

out, layers, hidden, heads, vocab, context = sys.argv[1], *map(int, sys.argv[2:])
shapes = {"wte.weight": [vocab, hidden], "wpe.weight": [context, hidden],
          "ln_f.weight": [hidden], "ln_f.bias": [hidden]}
for i in range(layers):
    p = f"h.{i}."
    shapes.update({p + "ln_1.weight": [hidden], p + "ln_1.bias": [hidden],
                   p + "attn.c_attn.weight": [3 * hidden, hidden], p + "attn.c_attn.bias": [3 * hidden],
                   p + "attn.c_proj.weight": [hidden, hidden], p + "attn.c_proj.bias": [hidden],
                   p + "ln_2.weight": [hidden], p + "ln_2.bias": [hidden],
                   p + "mlp.c_fc.weight": [4 * hidden, hidden], p + "mlp.c_fc.bias": [4 * hidden],
                   p + "mlp.c_proj.weight": [hidden, 4 * hidden], p + "mlp.c_proj.bias": [hidden]})
header, offset = {}, 0
for name, shape in shapes.items():
    n = 1
    for s in shape:
        n *= s
    header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + 4 * n]}
    offset += 4 * n
header["__metadata__"] = {"tessera.checkpoint_metadata": json.dumps({"gpt": {"heads": heads}})}
text = json.dumps(header).encode()
text += b" " * (-len(text) % 8)
value = array.array("f", [0.01]).tobytes()
with open(out, "wb") as f:
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for name, shape in shapes.items():
        n = (header[name]["data_offsets"][1] - header[name]["data_offsets"][0]) // 4
        f.write(value * n)
print(f"{out}: {offset / 2**20:.1f} MiB of weights")
