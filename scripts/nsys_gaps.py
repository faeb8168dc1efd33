#!/usr/bin/env python3
"""nsys_gaps.py: per-kernel time and the idle gap before each kernel, from an Nsight Systems
CSV GPU trace (`nsys stats -r cuda_gpu_trace -f csv`), over the decode steps of a bench run.

usage: scripts/nsys_gaps.py TRACE.csv [--last N]
Takes the last N kernel launches (default 4000: the end of the run is decode steps, which
replay one graph each). For each kernel name: launches, mean duration, mean gap from the end
of the kernel before it (same stream) to its start. Invariant: reads the CSV only; the sum of
durations plus gaps is the wall time of the window, printed last.
"""
import csv
import sys
from collections import defaultdict


def main():
    path = sys.argv[1]
    last = int(sys.argv[sys.argv.index("--last") + 1]) if "--last" in sys.argv else 4000
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            name = r.get("Name", "")
            start = r.get("Start (ns)") or r.get("Start")
            dur = r.get("Duration (ns)") or r.get("Duration")
            if start is None or dur is None or "memcpy" in name.lower() or "memset" in name.lower():
                continue
            rows.append((int(float(start)), int(float(dur)), name.split("(")[0].strip()))
    rows.sort()
    rows = rows[-last:]
    stat = defaultdict(lambda: [0, 0, 0])
    prev_end = None
    for s, d, n in rows:
        st = stat[n]
        st[0] += 1
        st[1] += d
        if prev_end is not None:
            st[2] += s - prev_end
        prev_end = max(prev_end or 0, s + d)
    tot_d = sum(v[1] for v in stat.values())
    tot_g = sum(v[2] for v in stat.values())
    print(f"{'kernel':<28} {'launches':>8} {'mean us':>9} {'gap us':>8} {'share':>6}")
    for n, (c, d, g) in sorted(stat.items(), key=lambda kv: -(kv[1][1] + kv[1][2])):
        print(f"{n:<28} {c:>8} {d / c / 1e3:>9.2f} {g / c / 1e3:>8.2f} {(d + g) / (tot_d + tot_g) * 100:>5.1f}%")
    wall = rows[-1][0] + rows[-1][1] - rows[0][0]
    print(f"window: {len(rows)} kernels, {wall / 1e6:.3f} ms wall; in kernels {tot_d / 1e6:.3f} ms, "
          f"gaps {tot_g / 1e6:.3f} ms (negative gaps mean overlap)")


if __name__ == "__main__":
    main()
