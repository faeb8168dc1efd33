#!/usr/bin/env bash
# gpu_llama.sh — on the GPU machine: llama.cpp and strata-exec side by side on llama.cpp's own
# quantizer mixes. Builds llama.cpp (llama-bench, llama-batched-bench, llama-quantize; CUDA,
# sm_90) from the trimmed source tree carried in the ignored folder llama.cpp-src/, writes our
# random Qwen3-30B-A3B-shaped Q8_0 file with tokenizer keys (strata-gguf random --vocab-from
# tests/data/tiny-chat-moe), quantizes it with llama-quantize --allow-requantize to Q4_K_M and
# IQ3_S (IQ4_XS when llama-quantize refuses IQ3_S, e.g. for want of an importance matrix; the
# table says which ran), and benches pp512 / tg128 on each file with llama-bench (-fa 1
# -ngl 99) and strata-exec bench (planned for plans/hardware/h200.toml), then prints one table.
#
# usage: scripts/gpu_llama.sh [build|files|bench|all] [OUTDIR]   (default: all, $OUT or /tmp)
# Binaries: target/gpu/ (scripts/build_gpu.sh on the dev box; carry target/gpu and
# llama.cpp-src with the device tool). Every stage keeps what it made under /tmp/gpu_llama
# and skips it when it is there, so a call cut short by the time limit resumes where it
# stopped; each stage prints its seconds. Disk: the Q8_0 file (~33 GB) is deleted once the
# Q4_K_M file (~19 GB) exists, and the second mix is quantized from Q4_K_M (llama-quantize's
# per-tensor type choices depend on the target mix, not on the source type), so at most
# ~52 GB sit on the 64 GB disk at once.
# Invariant: nothing outside /tmp/gpu_llama and OUTDIR is written; a failed stage stops the
# run with its log's tail.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
out=${2:-${OUT:-/tmp}}
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

q8=$work/q30-q8_0.gguf
q4km=$work/q30-q4_k_m.gguf
mix2_of() { ls "$work"/q30-iq3_s.gguf "$work"/q30-iq4_xs.gguf 2>/dev/null | head -1; }

if [ "$what" = files ] || [ "$what" = all ]; then
    stage "model files"
    q=$build/bin/llama-quantize
    [ -x "$q" ] || fail "no llama-quantize: run the build stage first"
    if [ ! -f "$q4km" ] && [ ! -f "$q8" ]; then
        t0=$(date +%s)
        "$bin/strata-gguf" random --arch qwen3moe --preset Q8_0 \
            --vocab-from tests/data/tiny-chat-moe --out "$q8.partial" >"$work/random.log" 2>&1 ||
            fail "strata-gguf random" "$work/random.log"
        mv "$q8.partial" "$q8"
        echo "Q8_0 written in $(($(date +%s) - t0)) s: $(du -h "$q8" | cut -f1)"
    fi
    if [ ! -f "$q4km" ]; then
        t0=$(date +%s)
        "$q" --allow-requantize "$q8" "$q4km.partial" Q4_K_M "$jobs" >"$work/quant_q4km.log" 2>&1 ||
            fail "llama-quantize Q4_K_M" "$work/quant_q4km.log"
        mv "$q4km.partial" "$q4km"
        echo "Q4_K_M quantized in $(($(date +%s) - t0)) s: $(du -h "$q4km" | cut -f1)"
        rm -f "$q8"
    fi
    if [ -z "$(mix2_of)" ]; then
        t0=$(date +%s)
        if "$q" --allow-requantize "$q4km" "$work/q30-iq3_s.partial" IQ3_S "$jobs" \
            >"$work/quant_iq3s.log" 2>&1; then
            mv "$work/q30-iq3_s.partial" "$work/q30-iq3_s.gguf"
        else
            echo "llama-quantize refused IQ3_S (log tail below); quantizing IQ4_XS instead"
            tail -5 "$work/quant_iq3s.log"
            rm -f "$work/q30-iq3_s.partial"
            "$q" --allow-requantize "$q4km" "$work/q30-iq4_xs.partial" IQ4_XS "$jobs" \
                >"$work/quant_iq4xs.log" 2>&1 || fail "llama-quantize IQ4_XS" "$work/quant_iq4xs.log"
            mv "$work/q30-iq4_xs.partial" "$work/q30-iq4_xs.gguf"
        fi
        echo "$(basename "$(mix2_of)") quantized in $(($(date +%s) - t0)) s: $(du -h "$(mix2_of)" | cut -f1)"
    fi
    df -h /tmp | tail -1
fi

if [ "$what" = bench ] || [ "$what" = all ]; then
    table=$out/llama_vs_strata.md
    {
        echo "| file | engine | pp512 tok/s | tg128 tok/s |"
        echo "| --- | --- | --- | --- |"
    } >"$table"
    for m in "$q4km" "$(mix2_of)"; do
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
