#!/usr/bin/env bash
# gpu_ncu.sh — on the GPU machine: Nsight Compute on one launch of each decode kernel of the
# Qwen3-30B-A3B-shaped Q8_0 benchmark (written and planned by `gpu_bench.sh bench` into /tmp),
# graphs off: duration, DRAM throughput, occupancy, registers and the warp stall summary, then
# the stall locations of the attention and the MoE gate/up.
# usage: scripts/gpu_ncu.sh [OUTDIR]   (reports in OUTDIR/ncu.txt and OUTDIR/ncu-stalls.txt,
# key lines printed)
# Invariant: reads /tmp/q30.plan only; changes nothing.
set -uo pipefail
out=${1:-${OUT:-/tmp}}
bin=target/gpu
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -z "$ncu" ]; then
    echo "ncu not installed"
    exit 0
fi
secs="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis"
# A 1-token prompt runs the decode kernels (one token per launch) through layer 0 first;
# the attention kernels only run in decode steps, here after a 512-token prompt.
"$ncu" --target-processes all $secs -c 7 \
    -k regex:'^(dq_qkv1|dq_mv1|dq_moe_gate_up|dq_moe_down_rows|dq_router_rows|dq_rope_store|rmsnorm_f32)$' \
    $bin/strata-exec bench /tmp/q30.plan -p 1 -n 2 -r 1 -q --no-graphs >"$out/ncu.txt" 2>&1
"$ncu" --target-processes all $secs -c 2 -k regex:'^(dq_attn_gqa|dq_attn_combine)$' \
    $bin/strata-exec bench /tmp/q30.plan -p 512 -n 2 -r 1 -q --no-graphs >>"$out/ncu.txt" 2>&1
# The head: the 49th dq_mv1 of a 1-token prompt (after 48 output projections).
"$ncu" --target-processes all $secs -c 1 --launch-skip 48 -k regex:'^dq_mv1$' \
    $bin/strata-exec bench /tmp/q30.plan -p 1 -n 2 -r 1 -q --no-graphs >>"$out/ncu.txt" 2>&1
# Where the attention and the gate/up product stall, by source line (the SASS and CUDA lines
# with the most stall samples), in a file of its own.
"$ncu" --target-processes all --section WarpStateStats --section SourceCounters -c 2 \
    -k regex:'^(dq_attn_gqa|dq_moe_gate_up)$' \
    $bin/strata-exec bench /tmp/q30.plan -p 512 -n 2 -r 1 -q --no-graphs >"$out/ncu-stalls.txt" 2>&1
grep -E "^  [a-z_0-9]+\(|^  dq_|^  rmsnorm|Duration|DRAM Throughput|Achieved Occupancy|Registers Per Thread|Warp Cycles Per Issued|Stall|stall|Block Limit Registers|L2 Hit Rate|Memory Throughput" \
    "$out/ncu.txt" | grep -v "^    ---" | cut -c1-200 | head -150
