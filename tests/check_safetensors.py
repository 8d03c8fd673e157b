#!/usr/bin/env python3
"""Reads a safetensors file with nothing but the standard library (struct,
json, array) and checks every float32 tensor's sum against SUMS.json: the
consolidated checkpoint must be readable by tools that are not tessera.

usage: check_safetensors.py FILE SUMS.json
"""
import array
import json
import struct
import sys

path, sums_path = sys.argv[1], sys.argv[2]
with open(path, "rb") as f:
    blob = f.read()
(n,) = struct.unpack("<Q", blob[:8])
header = json.loads(blob[8 : 8 + n])
data = blob[8 + n :]
expected = json.load(open(sums_path))
names = [k for k in header if k != "__metadata__"]
if sorted(names) != sorted(expected):
    sys.exit(f"tensor names differ: {sorted(set(names) ^ set(expected))}")
end = 0
for name in names:
    entry = header[name]
    if entry["dtype"] != "F32":
        sys.exit(f"{name}: dtype {entry['dtype']}, expected F32")
    begin, stop = entry["data_offsets"]
    count = 1
    for d in entry["shape"]:
        count *= d
    if stop - begin != 4 * count:
        sys.exit(f"{name}: {stop - begin} bytes for shape {entry['shape']}")
    values = array.array("f")
    values.frombytes(data[begin:stop])
    total = sum(values)
    want = expected[name]
    if abs(total - want) > 1e-4 * max(1.0, abs(want)):
        sys.exit(f"{name}: sum {total}, tessera says {want}")
    end = max(end, stop)
if end != len(data):
    sys.exit(f"{len(data) - end} bytes after the last tensor")
print(f"{path}: {len(names)} float32 tensors read with json + struct, sums match")
