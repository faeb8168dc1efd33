#!/usr/bin/env bash
# build_gpu.sh — on the dev box (no GPU, no CUDA toolkit): build what the GPU machine runs into
# target/gpu/ — the release strata-exec, strata-plan and strata-gguf, and the CUDA test
# binaries (backend_ops, cuda_engine, cuda_next, cuda_mtp, cuda_gemm, cuda_flash, cuda_sample, cuda_sample_proc, cuda_quants, cuda_offload, cuda_kvspill, cuda_kvhost, cuda_dp4a, cuda_mixed, cuda_hybrid_cost, cuda_probe_cost, probe_cli, runnable_truth) — then carry
# target/gpu to the GPU machine and run `scripts/gpu_bench.sh all "$OUT"` there.
#
# usage: scripts/build_gpu.sh [--baseline REV]
#   --baseline REV: also build strata-exec at git revision REV (in a worktree under
#   target/baseline-src) into target/gpu/base/, so one GPU call benches the two side by side
#   (`gpu_bench.sh compare`): the same plan, the same file, old binary vs new.
# Invariant: target/gpu holds one binary per test suite, all from this checkout (plus the
# baseline's strata-exec), stripped to fit the device tool's 64 MiB carry limit.
set -euo pipefail
cd "$(dirname "$0")/.."
base=""
if [ "${1:-}" = "--baseline" ]; then
    base=${2:?--baseline needs a git revision}
fi

# Paths of the test binaries built for `cargo test --release --no-run ARGS`, from cargo's
# JSON messages (the hash in their names changes).
test_bins() {
    cargo test --release -p strata-exec --no-run "$@" --message-format=json 2>/dev/null |
        python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["executable"])
'
}
# Without debug info: the device tool carries at most 64 MiB.
strip_into() {
    local dir=$1
    shift
    mkdir -p "$dir"
    for p in "$@"; do strip --strip-debug -o "$dir/$(basename "$p")" "$p"; done
}

# Cargo's output folder (CARGO_TARGET_DIR when set).
out=${CARGO_TARGET_DIR:-target}
cargo build --release -p strata-exec -p strata-plan -p strata-tools --bins
paths=$(test_bins --test backend_ops --test cuda_engine --test cuda_next --test cuda_mtp --test cuda_gemm --test cuda_flash --test cuda_sample --test cuda_sample_proc --test cuda_quants --test cuda_probe_cost --test cuda_offload --test cuda_kvspill --test cuda_kvhost --test cuda_dp4a --test cuda_mixed --test cuda_hybrid_cost --test probe_cli --test runnable_truth)
rm -rf target/gpu
strip_into target/gpu "$out/release/strata-exec" "$out/release/strata-plan" \
    "$out/release/strata-gguf" $paths

if [ -n "$base" ]; then
    src=target/baseline-src
    git worktree remove --force "$src" 2>/dev/null || true
    git worktree add --detach "$src" "$base"
    # The baseline builds in its own target folder (kept between runs), with its own plan
    # format: gpu_bench.sh plans for it with its own strata-plan.
    (cd "$src" && CARGO_TARGET_DIR="$PWD/../baseline-target" cargo build --release -p strata-exec -p strata-plan --bins)
    strip_into target/gpu/base target/baseline-target/release/strata-exec \
        target/baseline-target/release/strata-plan
    git rev-parse --short "$base" >target/gpu/base/REV
    git worktree remove --force "$src"
fi
ls -la target/gpu $([ -n "$base" ] && echo target/gpu/base)
du -sh target/gpu
