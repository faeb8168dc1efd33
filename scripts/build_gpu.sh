#!/usr/bin/env bash
# build_gpu.sh — on the dev box (no GPU, no CUDA toolkit): build what the GPU machine runs into
# target/gpu/ — the release strata-exec, strata-plan and strata-gguf, and the CUDA test
# binaries (cuda_ops, cuda_flash, cuda_gemm, cuda_engine) — then carry target/gpu to the GPU
# machine and run `scripts/gpu_bench.sh all "$OUT"` there.
# Invariant: target/gpu holds exactly one binary per test suite, all from this checkout, and
# fits the device tool's 64 MiB carry limit.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p strata-exec -p strata-plan -p strata-tools --bins
tests=(cuda_ops cuda_flash cuda_gemm cuda_engine)
args=()
for t in "${tests[@]}"; do args+=(--test "$t"); done
# The test binaries' paths, from cargo's JSON messages (the hash in the name changes).
paths=$(cargo test --release -p strata-exec --no-run "${args[@]}" --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["executable"])
')
rm -rf target/gpu
mkdir -p target/gpu
# Without debug info: the device tool carries at most 64 MiB (about 29 MiB stripped, 436 with).
for p in target/release/strata-exec target/release/strata-plan target/release/strata-gguf $paths; do
    strip --strip-debug -o "target/gpu/$(basename "$p")" "$p"
done
ls -la target/gpu
du -sh target/gpu
