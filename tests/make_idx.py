#!/usr/bin/env python3
"""Writes Fashion-MNIST-shaped idx files (random pixels with one bright row
per class, so a model can learn something) for the smoke tests of the
examples that read the dataset. LibTorch's MNIST reader insists on the real
counts, 60000 and 10000 images; the examples' --limit trains on fewer.

usage: make_idx.py DIR
"""
import os
import random
import struct
import sys


def write(directory, prefix, count, rng):
    images, labels = bytearray(), bytearray()
    for _ in range(count):
        label = rng.randrange(10)
        pixels = bytearray(rng.randbytes(28 * 28))
        pixels[28 * label:28 * label + 28] = b"\xff" * 28  # one bright row per class
        images += pixels
        labels.append(label)
    with open(os.path.join(directory, f"{prefix}-images-idx3-ubyte"), "wb") as f:
        f.write(struct.pack(">IIII", 2051, count, 28, 28) + images)
    with open(os.path.join(directory, f"{prefix}-labels-idx1-ubyte"), "wb") as f:
        f.write(struct.pack(">II", 2049, count) + labels)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    directory = sys.argv[1]
    train, test = 60000, 10000
    os.makedirs(directory, exist_ok=True)
    rng = random.Random(0)
    write(directory, "train", train, rng)
    write(directory, "t10k", test, rng)


if __name__ == "__main__":
    main()
