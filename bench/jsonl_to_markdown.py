#!/usr/bin/env python3
"""Turns comm_bench --json lines into a Markdown table.

usage: jsonl_to_markdown.py FILE [--min-bytes N] [--ops a,b]
"""
import argparse
import json


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("file")
    parser.add_argument("--min-bytes", type=int, default=0)
    parser.add_argument("--ops", default="")
    args = parser.parse_args()
    ops = set(args.ops.split(",")) if args.ops else None
    print("| op | bytes | time (us) | busbw (GB/s) | MPI time (us) | MPI busbw (GB/s) | ratio | #wrong |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with open(args.file) as f:
        for line in f:
            r = json.loads(line)
            if r["bytes"] < args.min_bytes or (ops and r["op"] not in ops):
                continue
            print(f"| {r['op']} | {r['bytes']} | {r['time_us']:.1f} | {r['busbw_gbps']:.3f} | "
                  f"{r['baseline_time_us']:.1f} | {r['baseline_busbw_gbps']:.3f} | {r['ratio']:.3f} | {r['wrong']} |")


if __name__ == "__main__":
    main()
