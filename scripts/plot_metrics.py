#!/usr/bin/env python3
"""Plot of a training run's metrics (train_gpt --metrics FILE): loss and
validation loss against the step, and tokens per second.

usage: plot_metrics.py METRICS.jsonl OUT.png
Needs matplotlib (Debian: python3-matplotlib; run with /usr/bin/python3).
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
train = [r for r in rows if r["kind"] == "train"]
evals = [r for r in rows if r["kind"] == "eval"]
if not train:
    sys.exit(f"{sys.argv[1]}: no training steps")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
ax1.plot([r["step"] for r in train], [r["loss"] for r in train], lw=0.8, label="train loss")
if evals:
    ax1.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="validation loss")
ax1.set_xlabel("step")
ax1.set_ylabel("cross entropy (nats)")
ax1.legend()
ax1.set_title("loss")
ax2.plot([r["step"] for r in train], [r["tokens_per_s"] for r in train], lw=0.8)
ax2.set_xlabel("step")
ax2.set_ylabel("tokens / s")
ax2.set_title("throughput")
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=100)
print(f"plot: {sys.argv[2]}")
