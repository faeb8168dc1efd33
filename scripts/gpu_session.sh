#!/usr/bin/env bash
# gpu_session.sh — one GPU lease's device calls in order, each under the device tool's
# 10-minute limit: what a session with new kernels runs first. Binaries from target/gpu
# (scripts/build_gpu.sh here), llama.cpp's trimmed source from .llama/llama.cpp-src.tar.xz
# (carry both). Each call keeps its files under /tmp for the next (the machine keeps them
# while it stays warm).
#   call1: the CUDA suites (gpu_bench.sh tests) while llama.cpp builds on the other cores
#   call2: the 30B-shaped Q8_0 and Q4_K_M files (tokenizer keys, so llama.cpp reads them),
#          then the dp4a A/B (gpu_bench.sh dp4a)
#   call3: llama.cpp against strata-exec on both files: llama-bench pp512/tg128 and
#          llama-batched-bench S_TG at 4 and 8 sequences, strata-exec bench -b 1,4,8 beside
#          them: the default (int8 products on Q8_0), --kernel-options f32-products and dp4a
#   call4: experts and KV beyond VRAM: gpu_bench.sh offload and kvspill
# usage: scripts/gpu_session.sh call1|call2|call3|call4 OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:?call1..call4}
out=${2:-${OUT:-/tmp}}
bin=$PWD/target/gpu
mkdir -p "$out" /work
[ -e /work/main ] || ln -sfn "$PWD" /work/main
q8=/tmp/q30-q8_0.gguf
q4=/tmp/q30-q4_k_m.gguf
lb=/tmp/gpu_llama/build/bin
case $what in
call1)
    if [ ! -f llama.cpp-src/CMakeLists.txt ]; then
        mkdir -p llama.cpp-src && tar -xJf .llama/llama.cpp-src.tar.xz -C llama.cpp-src
    fi
    scripts/gpu_llama.sh build "$out" >"$out/llama_build.log" 2>&1 &
    scripts/gpu_bench.sh tests "$out"
    wait
    tail -3 "$out/llama_build.log"
    grep -E "^test .*FAILED|panicked" "$out/tests.log" | head -40
    ;;
call2)
    [ -f $q8 ] || $bin/strata-gguf random --arch qwen3moe --preset Q8_0 \
        --vocab-from tests/data/tiny-chat-moe --out $q8 >/dev/null
    [ -f $q4 ] || $bin/strata-gguf random --arch qwen3moe --preset Q4_K_M --random-blocks \
        --vocab-from tests/data/tiny-chat-moe --out $q4 >/dev/null
    scripts/gpu_bench.sh dp4a "$out"
    ;;
call3)
    for m in $q8 $q4; do
        n=$(basename $m .gguf)
        echo "== llama-bench $n"
        $lb/llama-bench -m $m -p 512 -n 128 -fa 1 -ngl 99 -r 3 -o md 2>/dev/null | tee -a "$out/llama.txt"
        echo "== llama-batched-bench $n"
        $lb/llama-batched-bench -m $m -c 8192 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 1,4,8 \
            -fa 1 -ngl 99 2>/dev/null | grep -E "^\|" | tee -a "$out/llama.txt"
        plan=/tmp/$n-b8.plan
        $bin/strata-plan --hardware plans/hardware/h200.toml --model $m --max-context 4096 \
            --batch 8 -o $plan >/dev/null
        for opt in "" f32-products dp4a; do
            echo "== strata-exec bench $n ${opt:-default}"
            $bin/strata-exec bench $plan -p 512 -n 128 -b 1,4,8 -r 2 -q ${opt:+--kernel-options $opt} 2>&1 |
                tee -a "$out/strata.txt"
        done
    done
    ;;
call4)
    scripts/gpu_bench.sh offload "$out"
    scripts/gpu_bench.sh kvspill "$out"
    ;;
esac
