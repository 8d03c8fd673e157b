#!/usr/bin/env python3
"""PyTorch's own data parallelism on the GPT train_gpt trains, for
bench/cluster_compare.py: DDP, FSDP2 full shard, and HSDP (FSDP2 on a 2-D
mesh: shard inside a host, replicate across hosts), over gloo on CPU.

One process per rank, launched by mpirun (Open MPI's OMPI_COMM_WORLD_*
variables) or srun (SLURM_*); MASTER_ADDR and MASTER_PORT name rank 0's
host. Rank 0 writes one JSON line per step to --metrics, in train_gpt's
metrics format ("kind": "train", "seconds", "loss", "model_state_bytes"),
flushed, so that the driver reads both programs the same way.

The model is train_gpt's GPT-2 (learned positions, pre-norm blocks, exact
GELU, biases, tied embedding and head, vocabulary 256 of bytes); attention
is scaled_dot_product_attention. Model states per rank are the local
parameters, gradients and AdamW moments, counted as train_gpt counts them.
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def env_int(*names):
    for n in names:
        if n in os.environ:
            return int(os.environ[n])
    raise SystemExit(f"torch_gpt: none of {names} is set; launch with mpirun or srun")


class Block(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(hidden)
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.attn_proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden)
        self.c_fc = nn.Linear(hidden, 4 * hidden)
        self.mlp_proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, context, layers, hidden, heads):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(context, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.size(1)))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # tied head


def local_numel(t):
    return t.to_local().numel() if hasattr(t, "to_local") else t.numel()


def model_state_bytes(model, opt):
    params = sum(local_numel(p) for p in model.parameters())
    grads = sum(local_numel(p.grad) for p in model.parameters() if p.grad is not None)
    moments = sum(local_numel(v) for s in opt.state.values() for k, v in s.items() if k != "step")
    return 4 * (params + grads + moments)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["ddp", "fsdp2", "hsdp"], required=True)
    ap.add_argument("--ranks-per-host", type=int, required=True, help="HSDP's shard group")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, required=True, help="sequences per step, all ranks together")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--data", required=True)
    ap.add_argument("--metrics", required=True)
    a = ap.parse_args()

    torch.set_num_threads(1)
    rank = env_int("OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
    world = env_int("OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")
    if a.batch % world:
        raise SystemExit(f"torch_gpt: --batch {a.batch} is not a multiple of the {world} ranks")
    if a.mode == "hsdp" and (world % a.ranks_per_host or world == a.ranks_per_host):
        raise SystemExit(f"torch_gpt: hsdp needs several hosts of --ranks-per-host {a.ranks_per_host} ranks, got {world}")
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                            rank=rank, world_size=world)
    torch.manual_seed(1)
    model = GPT(256, a.seq, a.layers, a.hidden, a.heads)
    if a.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if a.mode == "fsdp2":
            mesh = init_device_mesh("cpu", (world,))
        else:
            mesh = init_device_mesh("cpu", (world // a.ranks_per_host, a.ranks_per_host),
                                    mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)

    tokens = torch.frombuffer(bytearray(open(a.data, "rb").read()), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(1000 + rank)
    rows = a.batch // world
    out = open(a.metrics, "w") if rank == 0 else None
    for step in range(1, a.steps + 1):
        start = torch.randint(0, tokens.numel() - a.seq - 1, (rows,), generator=gen)
        window = torch.stack([tokens[s:s + a.seq + 1] for s in start.tolist()])
        t0 = time.perf_counter()
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), window[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        state = model_state_bytes(model, opt)  # before zero_grad frees the gradients
        opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        if out:
            out.write(json.dumps({"kind": "train", "step": step, "loss": loss.item(), "seconds": seconds,
                                  "model_state_bytes": state}) + "\n")
            out.flush()
    dist.barrier()
    dist.destroy_process_group()
    if out and not math.isfinite(loss.item()):
        raise SystemExit("torch_gpt: the loss is not finite")


if __name__ == "__main__":
    main()
