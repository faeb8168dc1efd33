#!/usr/bin/env bash
# gpu_llama.sh — on the GPU machine: llama.cpp and strata-exec side by side on llama.cpp's
# quantizer mixes. Builds llama.cpp (llama-bench, llama-batched-bench, llama-quantize; CUDA,
# sm_90) from the trimmed source tree carried in the ignored folder llama.cpp-src/; writes
# random Qwen3-30B-A3B-shaped Q4_K_M and IQ3_S files with llama-quantize's per-tensor types and
# tokenizer keys (strata-gguf random --random-blocks --vocab-from tests/data/tiny-chat-moe);
# quantizes a small F32 model with llama-quantize itself into Q4_K_M, Q5_K_M, IQ4_XS and IQ3_S
# (the fixtures stage: files as llama.cpp's quantizer writes them, for the tests); and benches
# pp512 / tg128 on each large file with llama-bench (-fa 1 -ngl 99) and strata-exec bench
# (planned for plans/hardware/h200.toml), then prints one table.
#
# usage: scripts/gpu_llama.sh [build|files|fixtures|bench|all] [OUTDIR] [ARCH]
#   (default: all, $OUT or /tmp, qwen3moe). ARCH qwen3next writes and benches one random
#   Qwen3-Next-80B-A3B-shaped IQ3_S file instead (~33 GB: the disk holds it or the two 30B
#   files, not both, so run `rm -f /tmp/gpu_llama/*.gguf` between the two).
# Binaries: target/gpu/ (scripts/build_gpu.sh on the dev box; carry target/gpu and
# llama.cpp-src with the device tool). Every stage keeps what it made under /tmp/gpu_llama
# and skips it when it is there, so a call cut short by the time limit resumes where it
# stopped; each stage prints its seconds. Disk: ~19 GB (Q4_K_M) + ~13 GB (IQ3_S).
# Invariant: nothing outside /tmp/gpu_llama and OUTDIR is written; a failed stage stops the
# run with its log's tail.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
out=${2:-${OUT:-/tmp}}
arch=${3:-qwen3moe}
bin=$PWD/target/gpu
src=$PWD/llama.cpp-src
work=/tmp/gpu_llama
build=$work/build
mkdir -p "$work" "$out"
export RUST_BACKTRACE=1
jobs=$(nproc)
t_all=$(date +%s)

stage() { echo "== $1 ($(($(date +%s) - t_all)) s in)"; }
fail() {
    echo "FAILED: $1"
    [ -f "${2:-}" ] && tail -20 "$2"
    exit 1
}

if [ "$what" = build ] || [ "$what" = all ]; then
    stage "llama.cpp build"
    [ -f "$src/CMakeLists.txt" ] || fail "no llama.cpp source tree at $src (carry llama.cpp-src/)"
    if [ ! -x "$build/bin/llama-bench" ] || [ ! -x "$build/bin/llama-quantize" ]; then
        t0=$(date +%s)
        cmake -S "$src" -B "$build" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
            -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
            -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF \
            >"$work/cmake.log" 2>&1 || fail "cmake" "$work/cmake.log"
        cmake --build "$build" -j "$jobs" --target llama-bench llama-batched-bench llama-quantize \
            >"$work/make.log" 2>&1 || fail "llama.cpp build" "$work/make.log"
        echo "built in $(($(date +%s) - t0)) s"
    fi
fi

q4km=$work/q30-q4_k_m.gguf
iq3s=$work/q30-iq3_s.gguf
fix=$work/fixtures
# "PRESET:FILE" pairs of the files stage; the bench stage benches the same files.
case "$arch" in
qwen3moe) pairs="Q4_K_M:$q4km IQ3_S:$iq3s" ;;
qwen3next) pairs="IQ3_S:$work/next80-iq3_s.gguf" ;;
*) fail "ARCH is qwen3moe or qwen3next, not $arch" ;;
esac

if [ "$what" = files ] || [ "$what" = all ]; then
    stage "model files"
    # Both mixes straight from our writer (llama-quantize's per-tensor types, valid random
    # blocks: --random-blocks skips the quantizer search that made a 30B write take >10 min).
    for pair in $pairs; do
        preset=${pair%%:*}
        f=${pair#*:}
        [ -f "$f" ] && continue
        t0=$(date +%s)
        "$bin/strata-gguf" random --arch "$arch" --preset "$preset" --random-blocks \
            --vocab-from tests/data/tiny-chat-moe --out "$f.partial" >"$work/random_$preset.log" 2>&1 ||
            fail "strata-gguf random $preset" "$work/random_$preset.log"
        mv "$f.partial" "$f"
        echo "$preset written in $(($(date +%s) - t0)) s: $(du -h "$f" | cut -f1)"
    done
    df -h /tmp | tail -1
fi

if [ "$what" = fixtures ] || [ "$what" = all ]; then
    # Small files as llama.cpp's quantizer writes them, for the tests of issue 19 (committed
    # under tests/data/llama-quantized/): an F32 model of rows of 256, quantized by
    # llama-quantize to each mix, copied to OUTDIR/llama-quantized.
    stage "llama-quantize fixtures"
    q=$build/bin/llama-quantize
    [ -x "$q" ] || fail "no llama-quantize: run the build stage first"
    mkdir -p "$fix" "$out/llama-quantized"
    src_f32=$fix/small-f32.gguf
    if [ ! -f "$src_f32" ]; then
        "$bin/strata-gguf" random --arch qwen3moe --preset F32 --layers 2 --embd 256 --heads 4 \
            --kv-heads 2 --head-dim 64 --experts 4 --experts-used 2 --ff-exp 256 --vocab 400 \
            --ctx 4096 --seed 19 --vocab-from tests/data/tiny-chat-moe --out "$src_f32" \
            >"$fix/random.log" 2>&1 || fail "strata-gguf random F32" "$fix/random.log"
    fi
    for mix in Q4_K_M Q5_K_M IQ4_XS IQ3_S; do
        lower=$(echo "$mix" | tr 'A-Z' 'a-z')
        o=$out/llama-quantized/small-$lower.gguf
        "$q" "$src_f32" "$o" "$mix" 4 >"$fix/quant_$lower.log" 2>&1 ||
            fail "llama-quantize $mix" "$fix/quant_$lower.log"
        echo "$mix: $(du -h "$o" | cut -f1)"
    done
fi

if [ "$what" = bench ] || [ "$what" = all ]; then
    table=$out/llama_vs_strata.md
    {
        echo "| file | engine | pp512 tok/s | tg128 tok/s |"
        echo "| --- | --- | --- | --- |"
    } >"$table"
    for pair in $pairs; do
        m=${pair#*:}
        [ -f "$m" ] || { echo "no $m: run the files stage first"; continue; }
        name=$(basename "$m" .gguf)
        stage "llama-bench $name"
        lb=$work/llama_bench_$name.md
        "$build/bin/llama-bench" -m "$m" -p 512 -n 128 -fa 1 -ngl 99 -r 3 -o md >"$lb" 2>"$lb.err" ||
            { echo "llama-bench failed on $name"; tail -5 "$lb.err"; }
        cat "$lb"
        # The t/s column is the last: "| ... | pp512 | 12345.67 ± 89.01 |".
        lpp=$(grep -E "\| +pp512 +\|" "$lb" | awk -F'|' '{print $(NF-1)}' | xargs)
        ltg=$(grep -E "\| +tg128 +\|" "$lb" | awk -F'|' '{print $(NF-1)}' | xargs)
        echo "| $name | llama.cpp | ${lpp:--} | ${ltg:--} |" >>"$table"
        stage "strata-exec bench $name"
        plan=$work/$name.plan
        "$bin/strata-plan" --hardware plans/hardware/h200.toml --model "$m" --max-context 4096 \
            --batch 1 -o "$plan" >"$work/plan_$name.txt" 2>&1 ||
            { echo "strata-plan failed on $name"; tail -20 "$work/plan_$name.txt"; }
        sb=$work/strata_bench_$name.txt
        if [ -f "$plan" ]; then
            "$bin/strata-exec" bench "$plan" -p 512 -n 128 -r 3 -q >"$sb" 2>&1 ||
                { echo "strata-exec bench failed on $name"; tail -20 "$sb"; }
            cat "$sb"
        fi
        # "| name | cuda | pp512 | mean ± sd | predicted | ratio |": the fourth column.
        spp=$(grep -E "\| pp512 \|" "$sb" 2>/dev/null | awk -F'|' '{print $5}' | xargs)
        stg=$(grep -E "\| tg128[^|]*\|" "$sb" 2>/dev/null | awk -F'|' '{print $5}' | xargs)
        echo "| $name | strata-exec | ${spp:--} | ${stg:--} |" >>"$table"
    done
    stage "table"
    cat "$table"
fi
echo "== done in $(($(date +%s) - t_all)) s"
