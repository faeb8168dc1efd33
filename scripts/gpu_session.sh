#!/usr/bin/env bash
# gpu_session.sh — one GPU lease's device calls in order, each under the device tool's
# 10-minute limit. Binaries from target/gpu (scripts/build_gpu.sh here, carried packed),
# llama.cpp's trimmed source from .llama/llama.cpp-src.tar.xz (carry both). Each call keeps
# its files under /tmp for the next (the machine keeps them while it stays warm); the disk
# (64 GiB) holds the 80B file and the Q4_K_M file, or the Q8_0 and Q4_K_M files, not all three.
#   call1: llama.cpp builds and the Qwen3-Next-80B-A3B-shaped IQ3_S file (with its MTP block)
#          and the 30B Q4_K_M file are written, both in the background, while the CUDA suites
#          run (gpu_bench.sh tests)
#   call2: Qwen3-Next 80B (issues 17, 18): llama-bench and strata-exec bench (the plan's
#          prediction beside it) on the same file; then MTP speculation with every draft
#          forced right (--spec-oracle) at N = 1..4: the verify cost
#   call3: experts beyond VRAM (issues 16, 21): the 80B file removed, the skewed-routing 30B
#          Q8_0 written; a live probe; llama-bench -ncmoe 13 and 32 beside strata-exec bench
#          of 24 and 12 GiB card plans (the plan's miss policy and --miss-policy stream)
#   call4: decode (issues 20, 21): llama-bench and llama-batched-bench beside strata-exec bench
#          -b 1,4,8 on the Q8_0 and Q4_K_M files, the default products against
#          --kernel-options f32-products (and dp4a on Q4_K_M); plans from the live probe, so the
#          predictions of the per-type rates stand beside each figure
#   call5: a later lease after fixes: the changed kernels' suites, the 80B bench and verify
#          costs again
# usage: scripts/gpu_session.sh call1|call2|call3|call4|call5 OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:?call1..call4}
out=${2:-${OUT:-/tmp}}
bin=$PWD/target/gpu
mkdir -p "$out" /work
[ -e /work/main ] || ln -sfn "$PWD" /work/main
export RUST_BACKTRACE=1
voc=tests/data/tiny-chat-moe
next=/tmp/next80-iq3_s-mtp.gguf
q8=/tmp/q30-q8_0-skewed.gguf
q4=/tmp/q30-q4_k_m.gguf
lb=/tmp/gpu_llama/build/bin
t0=$(date +%s)
stamp() { echo "== $1 ($(($(date +%s) - t0)) s in)"; }
write() { # FILE ARGS...: strata-gguf random to FILE unless it is there
    local f=$1
    shift
    [ -f "$f" ] && return 0
    $bin/strata-gguf random "$@" --vocab-from $voc --out "$f.partial" >"$f.log" 2>&1 &&
        mv "$f.partial" "$f" && echo "wrote $f: $(du -h "$f" | cut -f1)"
}
case $what in
call1)
    if [ ! -f llama.cpp-src/CMakeLists.txt ]; then
        mkdir -p llama.cpp-src && tar -xJf .llama/llama.cpp-src.tar.xz -C llama.cpp-src
    fi
    scripts/gpu_llama.sh build "$out" >"$out/llama_build.log" 2>&1 &
    (write $next --arch qwen3next --preset IQ3_S --mtp 1 --random-blocks &&
        write $q4 --arch qwen3moe --preset Q4_K_M --random-blocks) >"$out/files.log" 2>&1 &
    scripts/gpu_bench.sh tests "$out"
    stamp "tests done"
    wait
    stamp "build and files done"
    tail -3 "$out/llama_build.log"
    cat "$out/files.log"
    df -h /tmp | tail -1
    grep -E "^test .*FAILED|panicked" "$out/tests.log" | head -40
    ;;
call2)
    stamp "llama-bench next80"
    $lb/llama-bench -m $next -p 512 -n 128 -fa 1 -ngl 99 -r 3 -o md 2>"$out/llama_next.err" |
        tee "$out/llama_next.md"
    tail -3 "$out/llama_next.err"
    $bin/strata-plan --hardware plans/hardware/h200.toml --model $next --max-context 4096 \
        --batch 1 -o /tmp/next.plan | head -12 | tee "$out/next_plan.txt"
    stamp "strata-exec bench next80"
    $bin/strata-exec bench /tmp/next.plan -p 512 -n 128 -r 3 -q 2>&1 | tee "$out/strata_next.txt"
    for n in 1 2 3 4; do
        stamp "--mtp --spec $n --spec-oracle"
        $bin/strata-plan --hardware plans/hardware/h200.toml --model $next --max-context 4096 \
            --batch 1 --mtp --spec $n -o /tmp/next-spec$n.plan | head -2
        $bin/strata-exec /tmp/next-spec$n.plan --prompt-tokens 1,2,3,4,5,6,7,8 -n 256 \
            --spec-oracle --format json -q 2>&1 | grep '^{' | tee -a "$out/spec.jsonl" | cut -c1-400
    done
    ;;
call3)
    rm -f $next
    stamp "writing the skewed Q8_0"
    write $q8 --arch qwen3moe --preset Q8_0 --routing skewed
    stamp "probe"
    $bin/strata-exec probe -o /tmp/h200-live.toml 2>&1 | tail -4
    cp /tmp/h200-live.toml "$out/"
    for gib in 24 12; do
        sed -e "s/^vram_bytes = .*/vram_bytes = $((gib << 30))/" \
            -e "s/^free_bytes = .*/free_bytes = $((gib << 30))/" /tmp/h200-live.toml >/tmp/live-${gib}g.toml
        $bin/strata-plan --hardware /tmp/live-${gib}g.toml --model $q8 --max-context 4096 --batch 1 \
            -o /tmp/q8-${gib}g.plan 2>&1 | grep -iE "expert|miss|predict|host|degrad" | head -12 |
            tee -a "$out/offload_plans.txt"
    done
    stamp "llama-bench -ncmoe 13,32"
    $lb/llama-bench -m $q8 -p 512 -n 128 -fa 1 -ngl 99 -ncmoe 13,32 -r 2 -o md 2>"$out/llama_ncmoe.err" |
        tee "$out/llama_ncmoe.md"
    for gib in 24 12; do
        for pol in auto stream; do
            stamp "strata-exec bench ${gib} GiB --miss-policy $pol"
            $bin/strata-exec bench /tmp/q8-${gib}g.plan -p 512 -n 128 -r 2 --miss-policy $pol 2>&1 |
                grep -vE "^\s*rep " | tee -a "$out/offload.txt"
        done
    done
    ;;
call4)
    [ -f $q8 ] || write $q8 --arch qwen3moe --preset Q8_0 --routing skewed
    [ -f /tmp/h200-live.toml ] || $bin/strata-exec probe -o /tmp/h200-live.toml 2>&1 | tail -2
    for m in $q8 $q4; do
        n=$(basename $m .gguf)
        stamp "llama.cpp $n"
        $lb/llama-bench -m $m -p 512 -n 128 -fa 1 -ngl 99 -r 3 -o md 2>/dev/null | tee -a "$out/llama.txt"
        $lb/llama-batched-bench -m $m -c 8192 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 1,4,8 \
            -fa 1 -ngl 99 2>/dev/null | grep -E "^\|" | tee -a "$out/llama.txt"
        plan=/tmp/$n-b8.plan
        $bin/strata-plan --hardware /tmp/h200-live.toml --model $m --max-context 4096 \
            --batch 8 -o $plan >/dev/null
        opts="default f32-products"
        [ $m = $q4 ] && opts="default dp4a dp4a,no-staging"
        for opt in $opts; do
            stamp "strata-exec bench $n $opt"
            o=$opt
            [ $o = default ] && o=
            $bin/strata-exec bench $plan -p 512 -n 128 -b 1,4,8 -r 2 -q ${o:+--kernel-options $o} 2>&1 |
                tee -a "$out/strata.txt"
        done
    done
    # The server under load (issue 20's "what to expect"): the Q8_0 plan of 8 slots, 1, 4 and
    # 8 concurrent streamed completions of a 512-token prompt and 128 tokens.
    stamp "serve load"
    $bin/strata-exec /tmp/$(basename $q8 .gguf)-b8.plan --serve --host 127.0.0.1 --port 8181 \
        >"$out/serve.log" 2>&1 &
    srv=$!
    for _ in $(seq 120); do
        curl -sf http://127.0.0.1:8181/health >/dev/null 2>&1 && break
        sleep 1
    done
    python3 scripts/serve_load.py --url http://127.0.0.1:8181 --clients 1,4,8 --prompt-tokens 512 \
        --max-tokens 128 --requests 2 2>&1 | tee "$out/serve_load.txt"
    kill -INT $srv
    wait $srv
    ;;
call5)
    # A second lease after fixes (no llama.cpp build: its figures are call2's): the suites of
    # the changed kernels, the 80B file again, its bench and the MTP verify costs.
    for t in backend_ops cuda_next cuda_mtp cuda_probe_cost; do
        "$bin"/$t-* --test-threads=1 2>&1 | grep -E "^test result|FAILED|panicked" | head -5
    done
    stamp "suites done"
    write $next --arch qwen3next --preset IQ3_S --mtp 1 --random-blocks
    $bin/strata-plan --hardware plans/hardware/h200.toml --model $next --max-context 4096 \
        --batch 1 -o /tmp/next.plan >/dev/null
    $bin/strata-exec bench /tmp/next.plan -p 512 -n 128 -r 2 -q 2>&1 | tee "$out/strata_next.txt"
    for n in 1 2 3 4; do
        stamp "--mtp --spec $n --spec-oracle"
        $bin/strata-plan --hardware plans/hardware/h200.toml --model $next --max-context 4096 \
            --batch 1 --mtp --spec $n -o /tmp/next-spec$n.plan >/dev/null
        $bin/strata-exec /tmp/next-spec$n.plan --prompt-tokens 1,2,3,4,5,6,7,8 -n 256 \
            --spec-oracle --format json -q 2>&1 | grep -E '^\{|error' | tee -a "$out/spec.jsonl" | cut -c1-600
    done
    ;;
esac
stamp "done"
