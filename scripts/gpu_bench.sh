#!/usr/bin/env bash
# On the GPU machine: the CUDA test suites, then the Qwen3-30B-A3B-shaped Q8_0 benchmark
# (our GGUF writer -> strata-plan for the H200 -> strata-exec bench) and the PyTorch baseline
# in the same run. Binaries come from target/gpu/ (built on the dev box by
# scripts/build_gpu.sh; carry target/gpu with the device tool).
# Usage: scripts/gpu_bench.sh [tests|memlock|serve|bench|compare|sample|split|torch|decode|dp4a|predict|offload|kvspill|spec|all] [OUTDIR]
# (dp4a, not part of all: the Q8_0 and Q4_K_M 30B-shaped files planned with 16 slots, decode
# tg128 at -b 1,4,16, interleaved twice in one call: on Q8_0 the default (int8 products)
# against --kernel-options f32-products and no-staging (the few-token int8 products reading
# their q8a rows from global memory); on Q4_K_M the default (f32 products) against dp4a and
# dp4a,no-staging; lines in OUTDIR/dp4a.txt.)
# (kvspill: the Q8_0 file at a 32k context all resident and with --kv-resident 4096, decode
# bench at depths 0, 8192 and 16384: spilled KV read over PCIe against VRAM; then the spilled
# plan with --kv-host stream and cpu: read over PCIe against attended on the host CPU.)
# (spec, not part of all: MTP speculation on the Qwen3-Next-80B-shaped Q4_K_M file (random
# blocks, one MTP block, ~48 GB written to /tmp) planned for the H200 with --mtp --spec 1..4;
# `strata-exec --spec-oracle` decodes 256 tokens plainly, then again with every draft forced
# right: the speed at full acceptance beside plain decode, one JSON line per N in
# OUTDIR/spec.jsonl.)
# (offload: the all-resident plan with --no-graphs (decode without graphs, no cache), then
# the Q8_0 file planned for 24 and 12 GiB cards (plans/hardware/h200.toml with its VRAM cut),
# each plan's host expert tier and notes, then bench pp512/tg128: the expert cache's misses
# from the pinned tier on the copy stream, PCIe bytes per prefill and per decode step; each
# budget with --miss-policy stream, cpu and auto: decode misses copied, computed on the CPU,
# or as the plan's cost model chose.)
# (predict: write the skewed-routing Q8_0 file, probe this machine, profile the file's routing
# (counts and LRU reuse curve), plan it all resident and for 24 and 12 GiB cards (the probe
# with its VRAM cut) with and without --expert-profile, bench each plan: the plan's predictions
# and hit rate beside the measurements, as JSON lines in OUTDIR/predict.jsonl and a table.)
# (memlock: strata-exec probe --memlock-test 64 under ulimit -l 8192.)
# (compare: the same bench with the baseline build of target/gpu/base (build_gpu.sh
# --baseline REV), planned by its own strata-plan, interleaved with this build's, three
# rounds each: the old-binary-vs-new figures.)
# (sample: decode with tokens drawn (temperature, top-k, top-p) on the device and, with
# --kernel-options host-pick, on the host, beside greedy, in one call.)
# (decode: the decode launch options side by side -- the fused attention's split size, the
# products' input staged in shared memory, the fused attention --
# then, where Nsight Systems is installed, each kernel's time and the idle gap before it
# inside the graph replays, by scripts/nsys_gaps.py.)
# (split: the same file planned over two H200s, run on this one GPU with a device object per
# stage, hand-offs by peer copy and by pinned host memory, and on one shared stream.)
# (serve needs the `openai` package; on the GPU machine carry it as wheels in .whl/ and put
# them on PYTHONPATH first, as the device README says.)
set -uo pipefail
what=${1:-all}
out=${2:-${OUT:-/tmp}}
bin=target/gpu
export RUST_BACKTRACE=1
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv | tee "$out/gpu.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
    # The test binaries find tests/data through the checkout path they were built in
    # (/work/main on the dev box); point it at this copy when it is missing.
    [ -e /work/main ] || { mkdir -p /work && ln -sfn "$PWD" /work/main; }
    # Suites that run the programs (probe_cli, runnable_truth) find them where cargo built
    # them on the dev box (CARGO_TARGET_DIR=/work/tgt): point that at target/gpu.
    [ -e /work/tgt/release/strata-exec ] || { mkdir -p /work/tgt && ln -sfn "$PWD/$bin" /work/tgt/release; }
    for t in $bin/backend_ops-* $bin/cuda_quants-* $bin/cuda_flash-* $bin/cuda_gemm-* $bin/cuda_engine-* $bin/cuda_next-* $bin/cuda_mtp-* $bin/cuda_sample-* $bin/cuda_sample_proc-* $bin/cuda_offload-* $bin/cuda_kvspill-* $bin/cuda_kvhost-* $bin/cuda_dp4a-* $bin/cuda_mixed-* $bin/cuda_hybrid_cost-* $bin/cuda_probe_cost-* $bin/probe_cli-* $bin/runnable_truth-*; do
        [ -x "$t" ] || continue
        echo "== $t"
        "$t" --test-threads=1 --nocapture 2>&1 | tee -a "$out/tests.log" | grep -E "^test |SKIP|vs |result|panicked|error|TIME" | head -60
    done
fi
if [ "$what" = memlock ] || [ "$what" = all ]; then
    echo "== does CUDA's pinned memory count against ulimit -l? (64 MiB pinned under 8 MiB)"
    (ulimit -l 8192 && $bin/strata-exec probe --memlock-test 64) 2>&1 | tee "$out/memlock.txt"
fi
if [ "$what" = serve ] || [ "$what" = all ]; then
    echo "== the openai client against strata-exec --serve on the CUDA engine"
    $bin/strata-plan --model tests/data/tiny-chat-moe --hardware plans/hardware/h200.toml \
        --max-context 256 --batch 2 --ubatch 8 -o /tmp/chat.plan >/dev/null
    scripts/gpu_serve_check.sh $bin/strata-exec /tmp/chat.plan 8181 2>&1 | tail -30 | tee "$out/serve.txt"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    m=/tmp/q30-q8_0.gguf
    if [ ! -f $m ]; then
        echo "== writing the random Q8_0 model"
        /usr/bin/time -f "%e s" $bin/strata-gguf random --arch qwen3moe --preset Q8_0 --out $m 2>&1 | tail -2
    fi
    $bin/strata-plan --hardware plans/hardware/h200.toml --model $m --max-context 4096 --batch 1 -o /tmp/q30.plan | tail -25
    echo "== strata-exec bench"
    $bin/strata-exec bench /tmp/q30.plan -p 512 -n 128 -r 3 -q 2>&1 | tee "$out/bench.txt"
fi
if [ "$what" = sample ] || [ "$what" = all ]; then
    [ -f /tmp/q30.plan ] || { echo "sample: run bench first (it writes /tmp/q30.plan)"; exit 1; }
    for run in "" "--temperature 0.8 --top-k 40 --top-p 0.95" "--temperature 1.0" \
        "--kernel-options host-pick --temperature 0.8 --top-k 40 --top-p 0.95" "--kernel-options host-pick --temperature 1.0"; do
        echo "== strata-exec bench (decode: ${run:-greedy})"
        $bin/strata-exec bench /tmp/q30.plan -p 512 -n 128 -r 3 -q $run 2>&1 |
            grep -E "\| cuda \| tg" | tee -a "$out/sample.txt"
    done
fi
if [ "$what" = split ] || [ "$what" = all ]; then
    m=/tmp/q30-q8_0.gguf
    [ -f $m ] || $bin/strata-gguf random --arch qwen3moe --preset Q8_0 --out $m >/dev/null
    # Planned with NVLink peers (peer copy), and without (through pinned host memory).
    grep -v '^peers' plans/hardware/h200-x2.toml >/tmp/h200-x2-nopeers.toml
    for hw in plans/hardware/h200-x2.toml /tmp/h200-x2-nopeers.toml; do
        $bin/strata-plan --hardware $hw --model $m --max-context 4096 --batch 1 \
            --layer-split 24 -o /tmp/q30-split-$(basename $hw .toml).plan | grep -E "^  device" | head -4
    done
    for run in "h200-x2 --device-map 0,0" "h200-x2-nopeers --device-map 0,0" "h200-x2 --gpu 0"; do
        set -- $run
        echo "== strata-exec bench (2-way split on one GPU: plan $1, ${*:2})"
        $bin/strata-exec bench /tmp/q30-split-$1.plan -p 512 -n 128 -r 3 -q "${@:2}" 2>&1 |
            tee -a "$out/split.txt"
    done
fi
if { [ "$what" = compare ] || [ "$what" = all ]; } && [ -d $bin/base ]; then
    m=/tmp/q30-q8_0.gguf
    [ -f $m ] || $bin/strata-gguf random --arch qwen3moe --preset Q8_0 --out $m >/dev/null
    [ -f /tmp/q30.plan ] || $bin/strata-plan --hardware plans/hardware/h200.toml --model $m \
        --max-context 4096 --batch 1 -o /tmp/q30.plan >/dev/null
    $bin/base/strata-plan --hardware plans/hardware/h200.toml --model $m --max-context 4096 \
        --batch 1 -o /tmp/q30-base.plan >/dev/null
    echo "== baseline $(cat $bin/base/REV) vs this build, interleaved, 3 rounds"
    for round in 1 2 3; do
        for who in base new; do
            if [ $who = base ]; then exe=$bin/base/strata-exec plan=/tmp/q30-base.plan; else exe=$bin/strata-exec plan=/tmp/q30.plan; fi
            $exe bench $plan -p 512 -n 128 -r 3 -q 2>&1 | grep -E "\| cuda" | sed "s/^/$who round $round: /" |
                tee -a "$out/compare.txt"
        done
    done
fi
if [ "$what" = decode ] || [ "$what" = all ]; then
    m=/tmp/q30-q8_0.gguf
    [ -f $m ] || $bin/strata-gguf random --arch qwen3moe --preset Q8_0 --out $m >/dev/null
    [ -f /tmp/q30.plan ] || $bin/strata-plan --hardware plans/hardware/h200.toml --model $m \
        --max-context 4096 --batch 1 -o /tmp/q30.plan >/dev/null
    for run in "" "attn-chunk=64" "no-staging" "unfused-attention" "unfused-topk"; do
        echo "== strata-exec bench: ${run:-default}"
        $bin/strata-exec bench /tmp/q30.plan -p 512 -n 128 -r 3 -q ${run:+--kernel-options $run} 2>&1 |
            grep -E "tok/s|\| cuda|warning" | tee -a "$out/decode.txt"
    done
    nsys=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
    if [ -n "$nsys" ]; then
        for run in "" "--no-pdl"; do
            echo "== nsys: decode kernels and gaps in graph replays ${run:-(default)}"
            rm -f /tmp/dec.nsys-rep /tmp/dec*.csv
            "$nsys" profile -q -t cuda --cuda-graph-trace=node -o /tmp/dec \
                $bin/strata-exec bench /tmp/q30.plan -p 512 -n 24 -r 1 -q $run >/dev/null 2>&1
            "$nsys" stats -q -r cuda_gpu_trace -f csv -o /tmp/dec /tmp/dec.nsys-rep >/dev/null 2>&1
            python3 scripts/nsys_gaps.py /tmp/dec*cuda_gpu_trace*.csv --last 4810 2>&1 |
                tee -a "$out/nsys.txt"
        done
    else
        echo "nsys not installed; no in-graph timeline"
    fi
fi
if [ "$what" = dp4a ]; then
    q8=/tmp/q30-q8_0.gguf
    q4=/tmp/q30-q4_k_m.gguf
    [ -f $q8 ] || $bin/strata-gguf random --arch qwen3moe --preset Q8_0 --out $q8 >/dev/null
    [ -f $q4 ] || $bin/strata-gguf random --arch qwen3moe --preset Q4_K_M --random-blocks \
        --vocab-from tests/data/tiny-chat-moe --out $q4 >/dev/null
    for m in $q8 $q4; do
        plan=/tmp/$(basename $m .gguf)-b16.plan
        $bin/strata-plan --hardware plans/hardware/h200.toml --model $m --max-context 4096 \
            --batch 16 -o $plan >/dev/null || { echo "dp4a: planning $m failed"; exit 1; }
        runs="f32-products default no-staging"
        [ $m = $q4 ] && runs="default dp4a dp4a,no-staging"
        for round in 1 2; do
            for run in $runs; do
                opt=""
                [ $run = default ] || opt="--kernel-options $run"
                echo "== $(basename $m) round $round: $run"
                $bin/strata-exec bench $plan -p 0 -n 128 -b 1,4,16 -r 2 -q $opt 2>&1 |
                    grep -E "\| cuda|warning|error" | sed "s/^/$(basename $m .gguf) $run: /" |
                    tee -a "$out/dp4a.txt"
            done
        done
    done
fi
if [ "$what" = predict ] || [ "$what" = all ]; then
    # The skewed-routing file (Zipf-like expert popularity, picks varying token to token): the
    # uniform file's routing is degenerate (hit rate 0.98 at any cache), so it tests nothing.
    m=/tmp/q30-q8_0-skewed.gguf
    if [ ! -f $m ]; then
        echo "== writing the skewed-routing Q8_0 model"
        /usr/bin/time -f "%e s" $bin/strata-gguf random --arch qwen3moe --preset Q8_0 --routing skewed --out $m 2>&1 | tail -2
    fi
    $bin/strata-exec probe -o /tmp/h200-live.toml 2>&1 | tail -3
    cp /tmp/h200-live.toml "$out/"
    for gib in 24 12; do
        b=$((gib * 1024 * 1024 * 1024))
        sed -e "s/^vram_bytes = .*/vram_bytes = $b/" -e "s/^free_bytes = .*/free_bytes = $b/" \
            /tmp/h200-live.toml >/tmp/h200-live-${gib}g.toml
    done
    # The routing of the file itself (prompts of random ids, 64 greedy tokens each): counts and
    # the LRU stack distances (profile v2). The all-resident CUDA engine does not read the
    # router's picks back, so the profile runs on the 24 GiB plan (the picks are the same).
    python3 -c "import random; random.seed(7); [print(','.join(str(random.randrange(1000, 150000)) for _ in range(64))) for _ in range(16)]" >/tmp/prompts.txt
    $bin/strata-plan --hardware /tmp/h200-live-24g.toml --model $m --max-context 4096 --batch 1 -o /tmp/prof.plan >/dev/null
    $bin/strata-exec profile /tmp/prof.plan --prompts /tmp/prompts.txt -n 64 -o /tmp/routing.txt 2>&1 | grep -E "profiled|LRU" | tee "$out/predict-profile.txt"
    cp /tmp/routing.txt "$out/routing-skewed.txt"
    rm -f "$out/predict.jsonl"
    for run in "h200-live 1" "h200-live-24g 1" "h200-live-12g 1" \
        "h200-live-24g 1 --expert-profile /tmp/routing.txt" "h200-live-12g 1 --expert-profile /tmp/routing.txt"; do
        set -- $run
        plan=/tmp/pred-$1-b$2${3:+-prof}.plan
        $bin/strata-plan --hardware /tmp/$1.toml --model $m --max-context 4096 --batch $2 "${@:3}" -o $plan |
            grep -iE "predict|expert|decode|prefill|degrad" | head -12 | tee -a "$out/predict-plans.txt"
        echo "== strata-exec bench $run"
        $bin/strata-exec bench $plan -p 512 -n 128 -b $2 -r 2 -q --format json 2>&1 | grep '^{' |
            sed "s|^{|{\"run\":\"$run\",|" | tee -a "$out/predict.jsonl" | cut -c1-300
    done
    # Predicted against measured, one line a plan.
    python3 scripts/predict_table.py "$out/predict.jsonl"
fi
if [ "$what" = offload ] || [ "$what" = all ]; then
    m=/tmp/q30-q8_0.gguf
    [ -f $m ] || $bin/strata-gguf random --arch qwen3moe --preset Q8_0 --out $m >/dev/null
    # The all-resident plan uncaptured (--no-graphs): the same launches as a cache stage's
    # decode without its per-layer read-back, copies and lookups, to price those.
    $bin/strata-plan --hardware plans/hardware/h200.toml --model $m --max-context 4096 \
        --batch 1 -o /tmp/q30.plan >/dev/null
    echo "== all resident, --no-graphs" | tee -a "$out/offload.txt"
    $bin/strata-exec bench /tmp/q30.plan -p 512 -n 128 -r 3 -q --no-graphs 2>&1 |
        grep -E "\| cuda" | tee -a "$out/offload.txt"
    for gib in 24 12; do
        sed -e "s/^vram_bytes = .*/vram_bytes = $((gib * 1024 * 1024 * 1024))/" \
            plans/hardware/h200.toml >/tmp/h200-${gib}g.toml
        echo "== ${gib} GiB card: plan"
        $bin/strata-plan --hardware /tmp/h200-${gib}g.toml --model $m --max-context 4096 --batch 1 \
            -o /tmp/q30-${gib}g.plan | grep -iE "host|expert|miss policy|predict|note" | head -14 | tee -a "$out/offload.txt"
        # The hybrid miss path: every decode miss streamed, every one on the CPU (nproc
        # threads), and the plan's own choice, on the same plan.
        for policy in stream cpu auto; do
            echo "== ${gib} GiB card: strata-exec bench --miss-policy $policy ($(nproc) CPU threads)"
            /usr/bin/time -f "wall %e s, max RSS %M KB" $bin/strata-exec bench /tmp/q30-${gib}g.plan \
                -p 512 -n 128 -r 3 --miss-policy $policy 2>&1 | grep -vE "^\s*rep " | tee -a "$out/offload.txt"
        done
    done
fi
if [ "$what" = kvspill ] || [ "$what" = all ]; then
    m=/tmp/q30-q8_0.gguf
    [ -f $m ] || $bin/strata-gguf random --arch qwen3moe --preset Q8_0 --out $m >/dev/null
    # Decode at depth with every KV cell in VRAM, then with 4096 cells a slot in VRAM and the
    # rest in mapped pinned host memory (read over PCIe by the attention kernels).
    for res in 32768 4096; do
        $bin/strata-plan --hardware plans/hardware/h200.toml --model $m --max-context 32768 \
            --batch 1 --kv-resident $res -o /tmp/q30-kv$res.plan | grep -iE "kv|pinned" | head -10 |
            tee -a "$out/kvspill.txt"
        echo "== --kv-resident $res: strata-exec bench" | tee -a "$out/kvspill.txt"
        $bin/strata-exec bench /tmp/q30-kv$res.plan -p 512 -n 64 -d 0,8192,16384 -r 3 -q 2>&1 |
            grep -E "\| cuda|error" | tee -a "$out/kvspill.txt"
    done
    # The spilled cells attended on the host CPU beside the GPU's window, against the GPU
    # reading them over PCIe (the plan's choice is its report's `kv host` line, above).
    for pol in stream cpu; do
        echo "== --kv-resident 4096 --kv-host $pol: strata-exec bench" | tee -a "$out/kvspill.txt"
        $bin/strata-exec bench /tmp/q30-kv4096.plan --kv-host $pol -p 512 -n 64 -d 0,8192,16384 \
            -r 3 -q 2>&1 | grep -E "\| cuda|error" | tee -a "$out/kvspill.txt"
    done
fi
if [ "$what" = spec ]; then
    m=/tmp/next-q4km-mtp.gguf
    if [ ! -f $m ]; then
        echo "== writing the random Qwen3-Next Q4_K_M model with its MTP block"
        /usr/bin/time -f "%e s" $bin/strata-gguf random --arch qwen3next --preset Q4_K_M --mtp 1 \
            --random-blocks --out $m 2>&1 | tail -2
    fi
    for n in 1 2 3 4; do
        echo "== --mtp --spec $n, --spec-oracle"
        $bin/strata-plan --hardware plans/hardware/h200.toml --model $m --max-context 4096 \
            --batch 1 --mtp --spec $n -o /tmp/next-spec$n.plan | head -3
        $bin/strata-exec /tmp/next-spec$n.plan --prompt-tokens 1,2,3,4,5,6,7,8 -n 256 \
            --spec-oracle --format json -q 2>&1 | tee -a "$out/spec.jsonl"
    done
fi
if [ "$what" = torch ] || [ "$what" = all ]; then
    echo "== PyTorch baseline"
    PYTHONUNBUFFERED=1 python3 scripts/bench_torch_moe.py -p 512 -n 128 -r 3 2>&1 | tail -3 | tee "$out/torch.json"
fi
