#!/usr/bin/env python3
"""tessera against PyTorch's DDP, FSDP2 and HSDP on the emulated cluster
(scripts/cluster.sh; docs/cluster.md "Against PyTorch").

usage: cluster_compare.py BUILD_DIR [--torch-python PY] [--data FILE]
           [--topologies 2x4,4x2] [--rates 1gbit,200mbit] [--rounds N]
           [--steps N] [--memory-gb GB] [--systems LIST] [--markdown FILE]
           [--plot FILE.png]
       cluster_compare.py --rows ROWS.jsonl [--markdown FILE] [--plot FILE.png]

For each topology (hosts x ranks per host) and link rate it brings a
cluster up and runs, interleaved round by round, the same GPT, batch and
data under every system: train_gpt with the planner's choice at
--memory-gb (`--plan auto`), every tessera preset (`--plan flags --spec X`,
so that each row has the planner's prediction), and bench/torch_gpt.py's
DDP, FSDP2 full shard and HSDP over gloo; on request (--systems) also
ddp-one-host and torch-ddp-one-host, the same ranks launched outside the
namespaces (the compute floor of this machine's cores, nothing crosses a
link). One JSON line per run on stdout:
  {"hosts", "ranks_per_host", "rate", "round", "system", "plan", "step_ms",
   "predicted_ms", "out_of_host_mb", "model_state_mb"}
then, with --markdown, the table of medians over rounds, and with --plot a
bar chart of the step times (needs matplotlib: Debian's python3-matplotlib,
/usr/bin/python3). --rows reads the JSON lines of an earlier run instead of
running.

step_ms is the median of rank 0's step times after the first two steps.
out_of_host_mb is measured by the kernel, the same way for every system:
the bytes each host's link carried to the switch during steps 3..N
(counters of the switch's ports, read when rank 0's metrics file shows step
2 and step N), per step, averaged over the hosts. model_state_mb is the
program's own count of a rank's parameters, gradients and optimizer states
(train_gpt's model_state_bytes; torch_gpt.py counts the local shards).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CLUSTER = os.path.join(ROOT, "scripts", "cluster.sh")
TESSERA = ["plan", "ddp", "zero1", "zero2", "zero3", "hpz", "mics", "{R,P(host),S}"]
TORCH = ["torch-ddp", "torch-fsdp2", "torch-hsdp"]
# The same ranks on the machine itself, outside the namespaces: DDP's compute
# floor on these cores, for "DDP across hosts within 10 % of one host".
ONE_HOST = "-one-host"


def cluster(*args):
    subprocess.run(["bash", CLUSTER, *args], check=True, stdout=subprocess.DEVNULL)


class SwitchCounters:
    """Bytes each host sent into the switch: the rx counters of the switch's
    ports h0..hN, read through a process that lives in the switch's
    namespace (/proc/PID/net/dev shows that namespace's interfaces)."""

    def __init__(self, name):
        self.proc = subprocess.Popen(["ip", "netns", "exec", f"{name}-sw", "sleep", "1000000"])
        time.sleep(0.2)

    def read(self):
        out = {}
        with open(f"/proc/{self.proc.pid}/net/dev") as f:
            for line in f.readlines()[2:]:
                iface, data = line.split(":", 1)
                iface = iface.strip()
                if iface.startswith("h") and iface[1:].isdigit():
                    out[iface] = int(data.split()[0])  # received by the switch = sent by the host
        return out

    def close(self):
        self.proc.kill()
        self.proc.wait()


def train_rows(path):
    rows = []
    try:
        with open(path) as f:
            for line in f:
                if line.endswith("\n") and '"train"' in line:
                    rows.append(json.loads(line))
    except FileNotFoundError:
        pass
    return rows


def command(system, a, hosts, ranks, metrics, port, master="10.231.0.1", plan=True):
    n = hosts * ranks
    model = ["--layers", "4", "--hidden", "128", "--heads", "4", "--seq", "128", "--batch", str(8 * n)]
    steps = ["--steps", str(a.steps), "--data", a.data, "--metrics", metrics]
    if system.startswith("torch-"):
        env = ["-x", f"MASTER_ADDR={master}", "-x", f"MASTER_PORT={port}"]
        for var in ("LD_LIBRARY_PATH", "PYTHONPATH"):
            if var in os.environ:
                env += ["-x", var]
        return env + [a.torch_python, os.path.join(HERE, "torch_gpt.py"), "--mode", system[6:],
                      "--ranks-per-host", str(ranks)] + model + steps
    train = [os.path.join(a.build, "examples", "train_gpt")] + model + steps + [
        "--sample", "0", "--eval-every", "0", "--log-every", "100"]
    if system == "plan":
        return train + ["--plan", "auto", "--memory-gb", str(a.memory_gb)]
    # One host has no measured links to plan with (--plan wants a comm_bench
    # file there): the same spec and buckets, without the prediction.
    return train + (["--plan", "flags"] if plan else []) + ["--spec", system]


def run_one(system, a, name, hosts, ranks, counters, out_dir, port):
    metrics = os.path.join(out_dir, f"{system.replace('{', '').replace('}', '').replace(',', '')}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    if system.endswith(ONE_HOST):
        cmd = ["mpirun", "-np", str(hosts * ranks)]
        cmd += command(system[:-len(ONE_HOST)], a, hosts, ranks, metrics, port, master="127.0.0.1", plan=False)
    else:
        cmd = ["bash", CLUSTER, "run", "--name", name, "--", "mpirun", "-np", str(hosts * ranks)]
        cmd += command(system, a, hosts, ranks, metrics, port)
    log = open(metrics + ".log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    marks = {}
    while proc.poll() is None:
        done = len(train_rows(metrics))
        for mark in (2, a.steps):
            if done >= mark and mark not in marks:
                marks[mark] = counters.read()
        time.sleep(0.02)
    log.close()
    text = open(metrics + ".log").read()
    if proc.returncode != 0 or len(marks) < 2:
        sys.exit(f"cluster_compare: {system} failed (exit {proc.returncode}):\n{text[-3000:]}")
    rows = train_rows(metrics)
    seconds = [r["seconds"] for r in rows[2:]]
    sent = sum(marks[a.steps][k] - marks[2][k] for k in marks[2]) / hosts / (a.steps - 2)
    result = {"system": system, "step_ms": 1e3 * statistics.median(seconds), "out_of_host_mb": sent / 1e6,
              "model_state_mb": rows[-1]["model_state_bytes"] / 1e6, "predicted_ms": None, "plan": ""}
    with open(metrics) as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") == "plan":
                result["predicted_ms"] = 1e3 * r["predicted_s"]
    for line in text.splitlines():
        if line.startswith("planner: ") and "step predicted" in line:
            result["plan"] = line[len("planner: "):].split(" | ")[0]
    return result


def markdown(rows):
    keys = sorted({(r["hosts"], r["ranks_per_host"], r["rate"]) for r in rows}, key=lambda k: (k[0], -rate_bits(k[2])))
    out = []
    for hosts, ranks, rate in keys:
        mine = [r for r in rows if (r["hosts"], r["ranks_per_host"], r["rate"]) == (hosts, ranks, rate)]
        med = {}
        for r in mine:
            med.setdefault(r["system"], []).append(r)
        out.append(f"\n{hosts} hosts x {ranks} ranks, {rate} per host ({len(mine) // len(med)} rounds, medians)\n")
        out.append("| system | plan | step ms | predicted ms | measured / predicted | MB out of a host per step "
                   "| model states MB per rank |")
        out.append("| --- | --- | --- | --- | --- | --- | --- |")
        for system, rs in med.items():
            step = statistics.median(r["step_ms"] for r in rs)
            pred = [r["predicted_ms"] for r in rs if r["predicted_ms"]]
            p = statistics.median(pred) if pred else None
            out.append(f"| {system} | {rs[0]['plan']} | {step:.0f} | {f'{p:.0f}' if p else ''} | "
                       f"{f'{step / p:.2f}' if p else ''} | {statistics.median(r['out_of_host_mb'] for r in rs):.2f} | "
                       f"{rs[0]['model_state_mb']:.2f} |")
        step = {s: statistics.median(r["step_ms"] for r in rs) for s, rs in med.items()}
        ratios = [f"{a} / {b} = {step[a] / step[b]:.2f}" for a, b in
                  (("plan", "torch-fsdp2"), ("plan", "torch-hsdp"), ("ddp", "torch-ddp"), ("ddp", "ddp" + ONE_HOST),
                   ("torch-ddp", "torch-ddp" + ONE_HOST)) if a in step and b in step]
        if ratios:
            out.append("\nstep-time ratios: " + "; ".join(ratios))
    return "\n".join(out) + "\n"


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["hosts"], r["ranks_per_host"], r["rate"]) for r in rows}, key=lambda k: (k[0], -rate_bits(k[2])))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        steps = []
        for system in systems:
            rs = [r["step_ms"] for r in rows if (r["hosts"], r["ranks_per_host"], r["rate"]) == key and r["system"] == system]
            steps.append(statistics.median(rs) if rs else 0)
        ax.bar([j + (i - (len(keys) - 1) / 2) * width for j in range(len(systems))], steps, width,
               label=f"{key[0]} hosts x {key[1]}, {key[2]}")
    ax.set_xticks(range(len(systems)))
    ax.set_xticklabels(systems, rotation=20)
    ax.set_ylabel("step (ms, median)")
    ax.set_title("tessera's presets and planner choice against PyTorch's DDP, FSDP2, HSDP (gloo) on the emulated cluster")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def rate_bits(rate):
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for u, f in units.items():
        if rate.endswith(u):
            return float(rate[:-len(u)]) * f
    return 0


def main():
    ap = argparse.ArgumentParser(description="tessera against PyTorch DDP, FSDP2 and HSDP on the emulated cluster")
    ap.add_argument("build", nargs="?", help="tessera's build directory (examples/train_gpt)")
    ap.add_argument("--rows", help="JSON lines of an earlier run: only write --markdown and --plot")
    ap.add_argument("--plot", help="also draw the step times here (PNG)")
    ap.add_argument("--torch-python", default=os.path.join(ROOT, "build-latest", "venv", "bin", "python"),
                    help="a python with torch (scripts/setup-latest-torch.sh makes one)")
    ap.add_argument("--data", default=os.path.join(ROOT, "README.md"))
    ap.add_argument("--topologies", default="2x4,4x2", help="HOSTSxRANKS,...")
    ap.add_argument("--rates", default="1gbit,200mbit")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    # The planner's peak per rank for this GPT at 8 sequences per rank: DDP
    # 51.2 MB (13.5 MB of model states, 37.8 MB of activations), zero1,
    # zero2 and mics 45.3 MB, zero3 44.1 MB; PyTorch's FSDP2 and HSDP run the
    # same batch unlimited. 48 MB rules out DDP alone, as AMSP's setting does.
    ap.add_argument("--memory-gb", type=float, default=0.048,
                    help="--plan auto's limit per rank; the default rules out DDP (its predicted peak 51.2 MB) "
                         "and leaves every sharded spec at one micro-batch (44-45 MB)")
    ap.add_argument("--systems", default=",".join(TESSERA + TORCH).replace("{R,P(host),S}", "mix"),
                    help="which of: " + ", ".join(TESSERA[:-1] + ["mix ({R,P(host),S})"] + TORCH) +
                         f"; ddp{ONE_HOST} and torch-ddp{ONE_HOST} run the same ranks outside the namespaces")
    ap.add_argument("--markdown", help="also write the table of medians here")
    a = ap.parse_args()
    if a.rows:
        rows = [json.loads(line) for line in open(a.rows) if line.strip()]
        if a.markdown:
            with open(a.markdown, "w") as f:
                f.write(markdown(rows))
        if a.plot:
            plot(rows, a.plot)
        return
    if not a.build:
        ap.error("BUILD_DIR is needed unless --rows is given")
    if a.steps < 4:
        ap.error(f"--steps {a.steps}: at least 4 (the first two are warm-up)")
    topologies = []
    for topo in a.topologies.split(","):
        hosts, _, ranks = topo.partition("x")
        if not (hosts.isdigit() and ranks.isdigit() and int(hosts) >= 2 and int(ranks) >= 1):
            ap.error(f"--topologies: '{topo}' is not HOSTSxRANKS with at least 2 hosts (e.g. 2x4)")
        topologies.append((int(hosts), int(ranks)))
    systems = [("{R,P(host),S}" if s == "mix" else s) for s in a.systems.split(",")]
    for s in systems:
        if s not in TESSERA + TORCH and s not in ("ddp" + ONE_HOST, "torch-ddp" + ONE_HOST):
            ap.error(f"--systems: unknown system {s!r}")
    if any(s.startswith("torch-") for s in systems) and not os.access(a.torch_python, os.X_OK):
        ap.error(f"--torch-python {a.torch_python} is not executable (scripts/setup-latest-torch.sh makes one)")
    for var, value in (("OMPI_ALLOW_RUN_AS_ROOT", "1"), ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
                       ("OMPI_MCA_rmaps_base_oversubscribe", "1"), ("OMPI_MCA_mpi_yield_when_idle", "1"),
                       ("OMP_NUM_THREADS", "1"), ("OPENBLAS_NUM_THREADS", "1")):
        os.environ.setdefault(var, value)
    name = f"cc{os.getpid() % 100000}"
    rows = []
    with tempfile.TemporaryDirectory() as out_dir:
        for hosts, ranks in topologies:
            for rate in a.rates.split(","):
                cluster("up", "--name", name, "--hosts", str(hosts), "--ranks", str(ranks), "--rate", rate)
                counters = SwitchCounters(name)
                try:
                    for rnd in range(a.rounds):
                        for i, system in enumerate(systems):
                            r = run_one(system, a, name, hosts, ranks, counters, out_dir, 29500 + i)
                            r.update({"hosts": hosts, "ranks_per_host": ranks, "rate": rate, "round": rnd})
                            rows.append(r)
                            print(json.dumps(r), flush=True)
                finally:
                    counters.close()
                    subprocess.run(["bash", CLUSTER, "down", "--name", name], stdout=subprocess.DEVNULL)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(markdown(rows))
    if a.plot:
        plot(rows, a.plot)


if __name__ == "__main__":
    main()
