#!/usr/bin/env bash
# build_gpu.sh — on the dev box (no GPU, no CUDA toolkit): build what the GPU machine runs into
# target/gpu/ — the release strata-exec, strata-plan and strata-gguf, and the CUDA test
# binaries (cuda_ops, cuda_decode_ops, cuda_flash, cuda_gemm, cuda_engine, cuda_sample) — then carry
# target/gpu to the GPU machine and run `scripts/gpu_bench.sh all "$OUT"` there.
#
# usage: scripts/build_gpu.sh [PATCH...]
#   PATCH (e.g. patches/device-greedy.patch; several are applied in the order given): also
#   build strata-exec, cuda_ops, cuda_decode_ops and cuda_engine with them applied into
#   target/gpu/patch/ (about 55 MiB in all with main's; carry .whl in a call of its own), so
#   that one GPU call checks and benchmarks main and the patched build side by side
#   (`gpu_bench.sh patch`). The patches are applied to this working tree for the build and
#   always reversed afterwards.
# Invariant: target/gpu holds one binary per test suite, all from this checkout (plus the
# patched build's under target/gpu/patch), and fits the device tool's 64 MiB carry limit.
set -euo pipefail
cd "$(dirname "$0")/.."
patches=("$@")
# Each patch must apply on top of the ones before it.
applied=()
undo() {
    local i
    for ((i = ${#applied[@]} - 1; i >= 0; i--)); do git apply -R "${applied[$i]}"; done
    applied=()
}
for p in "${patches[@]}"; do
    git apply --check "$p" || { undo; exit 1; }
    git apply "$p"
    applied+=("$p")
done
undo

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
# Without debug info: the device tool carries at most 64 MiB (about 30 MiB stripped, 436 with).
strip_into() {
    local dir=$1
    shift
    mkdir -p "$dir"
    for p in "$@"; do strip --strip-debug -o "$dir/$(basename "$p")" "$p"; done
}

cargo build --release -p strata-exec -p strata-plan -p strata-tools --bins
paths=$(test_bins --test cuda_ops --test cuda_decode_ops --test cuda_flash --test cuda_gemm --test cuda_engine --test cuda_sample)
rm -rf target/gpu
strip_into target/gpu target/release/strata-exec target/release/strata-plan \
    target/release/strata-gguf $paths

if [ ${#patches[@]} -gt 0 ]; then
    trap undo EXIT
    for p in "${patches[@]}"; do
        git apply "$p"
        applied+=("$p")
    done
    cargo build --release -p strata-exec --bin strata-exec
    paths=$(test_bins --test cuda_ops --test cuda_decode_ops --test cuda_engine)
    strip_into target/gpu/patch target/release/strata-exec $paths
    for p in "${patches[@]}"; do basename "$p"; done >target/gpu/patch/NAME
    undo
    trap - EXIT
    # Leave target/release as main built it.
    cargo build --release -p strata-exec --bin strata-exec
fi
ls -la target/gpu $([ ${#patches[@]} -gt 0 ] && echo target/gpu/patch)
du -sh target/gpu
