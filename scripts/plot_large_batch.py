#!/usr/bin/env python3
"""Table and plot of the large-batch study (scripts/large-batch-study.sh).

usage: plot_large_batch.py RESULTS.jsonl OUT.png
Prints a markdown table: for each optimizer and batch, the best final test
accuracy over the learning-rate grid, that rate, and the accuracy at every
rate of the grid.
"""
import collections
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
runs = collections.defaultdict(list)  # (optimizer, batch, lr) -> epochs
for r in rows:
    runs[(r["optimizer"], r["batch"], r["peak_lr"])].append(r)

final = {k: v[-1] for k, v in runs.items()}
configs = sorted({(k[0], k[1]) for k in runs}, key=lambda c: (c[1], c[0]))
print("| batch | optimizer | best test accuracy | its peak lr | accuracy at each lr of the grid | seconds (best run) |")
print("| ---: | --- | ---: | ---: | --- | ---: |")
best = {}
for opt, batch in configs:
    grid = sorted((k[2], final[k]) for k in final if k[0] == opt and k[1] == batch)
    lr, top = max(grid, key=lambda g: g[1]["test_accuracy"])
    best[(opt, batch)] = lr
    cells = ", ".join(f"{g[0]:g}: {g[1]['test_accuracy']:.4f}" for g in grid)
    print(f"| {batch} | {opt} | {top['test_accuracy']:.4f} | {lr:g} | {cells} | {top['seconds']:.0f} |")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
styles = {"adamw": "-", "lamb": "--", "lars": ":"}
for (opt, batch), lr in best.items():
    epochs = runs[(opt, batch, lr)]
    ax1.plot([e["epoch"] for e in epochs], [e["test_accuracy"] for e in epochs], styles[opt],
             label=f"{opt} b{batch} lr {lr:g}")
    grid = sorted((k[2], final[k]["test_accuracy"]) for k in final if k[0] == opt and k[1] == batch)
    ax2.plot([g[0] for g in grid], [g[1] for g in grid], styles[opt], marker="o", label=f"{opt} b{batch}")
ax1.set_xlabel("epoch")
ax1.set_ylabel("test accuracy")
ax1.set_title("best learning rate of each grid")
ax1.set_ylim(0.8, 0.91)
ax1.legend(fontsize=7)
ax2.set_xscale("log")
ax2.set_xlabel("peak learning rate")
ax2.set_ylabel("final test accuracy")
ax2.set_title("learning-rate grids")
ax2.set_ylim(0.7, 0.91)
ax2.legend(fontsize=7)
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=110)
print(f"\nplot: {sys.argv[2]}")
