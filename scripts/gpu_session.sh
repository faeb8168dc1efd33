#!/usr/bin/env bash
# gpu_session.sh — one GPU lease's device calls in order, each under the device tool's
# 10-minute limit. Binaries from target/gpu (scripts/build_gpu.sh here, carried packed),
# llama.cpp's trimmed source from .llama/llama.cpp-src.tar.xz (carry both). Each call keeps
# its files under /tmp for the next (the machine keeps them while it stays warm); the disk
# (64 GiB) holds the 80B file and the Q4_K_M file, or the Q8_0 and Q4_K_M files, not all three.
#   call1: llama.cpp builds and the Qwen3-Next-80B-A3B-shaped IQ3_S file (with its MTP block)
#          and the 30B Q4_K_M file are written, both in the background, while the CUDA suites
#          run (gpu_bench.sh tests)
#   call2: Qwen3-Next 80B (issues 17, 18, 21): llama-bench and strata-exec bench (the plan's
#          prediction beside it) on the same file, the GM_ANY prefill products' default against
#          --kernel-options any-pipelined (the pipelined loader, opt-in until this A/B), a --profile pass (where the
#          prefill and decode time goes now); then MTP speculation with every draft forced
#          right (--spec-oracle) at N = 1..4: the verify cost
#   call3: experts beyond VRAM (issues 16, 21): the 80B file removed, the skewed-routing 30B
#          Q8_0 written; a live probe; the file's own routing profiled; llama-bench -ncmoe 13
#          and 32 beside strata-exec bench of 24 and 12 GiB card plans, each without and with
#          --expert-profile (the prediction's hit rate and tok/s beside the measurement; the
#          prefill's bytes streamed a pass with the scan-resistant cache)
#   call4: decode at depth (issue 20): llama-bench -d 16384 beside strata-exec bench -d 16384
#          on the Q8_0 file (batch 1, and 4 sequences), the all-resident pp512/tg128 again
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
    for o in default any-pipelined dp4a any-pipelined,dp4a; do
        stamp "strata-exec bench next80 ($o)"
        opt=
        [ $o = default ] || opt="--kernel-options $o"
        $bin/strata-exec bench /tmp/next.plan -p 512 -n 128 -r 3 -q $opt 2>&1 | tee -a "$out/strata_next.txt"
    done
    stamp "profile next80"
    $bin/strata-exec bench /tmp/next.plan -p 512 -n 8 -r 1 --profile 2>&1 | tail -40 >"$out/next_profile.txt"
    head -30 "$out/next_profile.txt"
    for n in 1 2 3 4; do
        stamp "--mtp --spec $n --spec-oracle"
        $bin/strata-plan --hardware plans/hardware/h200.toml --model $next --max-context 4096 \
            --batch 1 --mtp --spec $n -o /tmp/next-spec$n.plan | head -2
        $bin/strata-exec /tmp/next-spec$n.plan --prompt-tokens 1,2,3,4,5,6,7,8 -n 128 \
            --spec-oracle --format json -q 2>&1 | grep -E '^\{|error' | tee -a "$out/spec.jsonl" | cut -c1-400
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
    done
    # The file's own routing (16 prompts of random ids, 64 greedy tokens each) on the 24 GiB
    # plan (the all-resident engine does not read the picks back).
    python3 -c "import random; random.seed(7); [print(','.join(str(random.randrange(1000, 150000)) for _ in range(64))) for _ in range(16)]" >/tmp/prompts.txt
    $bin/strata-plan --hardware /tmp/live-24g.toml --model $q8 --max-context 4096 --batch 1 -o /tmp/prof.plan >/dev/null
    stamp "profile the routing"
    $bin/strata-exec profile /tmp/prof.plan --prompts /tmp/prompts.txt -n 64 -o /tmp/routing.txt 2>&1 |
        grep -E "profiled|LRU" | tee "$out/routing_profile.txt"
    for gib in 24 12; do
        for prof in "" "--expert-profile /tmp/routing.txt"; do
            plan=/tmp/q8-${gib}g${prof:+-prof}.plan
            $bin/strata-plan --hardware /tmp/live-${gib}g.toml --model $q8 --max-context 4096 --batch 1 \
                $prof -o $plan 2>&1 | grep -iE "expert|miss|predict|host|degrad" | head -12 |
                tee -a "$out/offload_plans.txt"
        done
    done
    stamp "llama-bench -ncmoe 13,32"
    $lb/llama-bench -m $q8 -p 512 -n 128 -fa 1 -ngl 99 -ncmoe 13,32 -r 2 -o md 2>"$out/llama_ncmoe.err" |
        tee "$out/llama_ncmoe.md"
    for gib in 24 12; do
        for v in "" -prof; do
            stamp "strata-exec bench ${gib} GiB${v}"
            $bin/strata-exec bench /tmp/q8-${gib}g$v.plan -p 512 -n 128 -r 2 --format json -q 2>&1 |
                grep '^{' | sed "s|^{|{\"run\":\"${gib}g$v\",|" | tee -a "$out/offload.jsonl" | cut -c1-300
        done
    done
    python3 scripts/predict_table.py "$out/offload.jsonl"
    ;;
call4)
    [ -f $q8 ] || write $q8 --arch qwen3moe --preset Q8_0 --routing skewed
    [ -f /tmp/h200-live.toml ] || $bin/strata-exec probe -o /tmp/h200-live.toml 2>&1 | tail -2
    stamp "llama.cpp at depth 16384"
    $lb/llama-bench -m $q8 -p 512 -n 128 -fa 1 -ngl 99 -r 2 -o md 2>/dev/null | tee -a "$out/depth.txt"
    $lb/llama-bench -m $q8 -p 0 -n 128 -d 16384 -fa 1 -ngl 99 -r 2 -o md 2>/dev/null | tee -a "$out/depth.txt"
    $lb/llama-batched-bench -m $q8 -c 70000 -b 2048 -ub 512 -npp 16384 -ntg 128 -npl 1,4 \
        -fa 1 -ngl 99 2>/dev/null | grep -E "^\|" | tee -a "$out/depth.txt"
    $bin/strata-plan --hardware /tmp/h200-live.toml --model $q8 --max-context 16640 --batch 4 \
        -o /tmp/q8-deep.plan | head -6 | tee -a "$out/depth.txt"
    stamp "strata-exec at depth 16384"
    $bin/strata-exec bench /tmp/q8-deep.plan -p 512 -n 128 -r 2 -q 2>&1 | tee -a "$out/depth.txt"
    $bin/strata-exec bench /tmp/q8-deep.plan -p 0 -n 128 -d 16384 -b 1,4 -r 2 -q 2>&1 | tee -a "$out/depth.txt"
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
