#!/usr/bin/env bash
# bench_cpu.sh — prefill and decode tokens/s of strata-exec's CPU backend on one model.
# Owns: planning MODEL for plans/hardware/cpu.toml (one cpu device) and timing R runs of
# `strata-exec PLAN --prompt-tokens ... -n N --format json`. Invariant: every run uses the
# same plan and prompt; the printed numbers are strata-exec's own timings (prefill = prompt
# tokens / prefill seconds; decode = decode steps / decode seconds), no load time included.
#
# Usage: scripts/bench_cpu.sh STRATA_EXEC MODEL [PROMPT_LEN=64] [N=32] [REPS=3]
#   STRATA_EXEC  a strata-exec binary (release build)
#   MODEL        a .gguf file or a Hugging Face safetensors folder
#   env STRATA_PLAN   the strata-plan binary (default: next to STRATA_EXEC)
#   env UBATCH        prefill chunk (default 64)
# Prints one JSON line per run and a final summary line:
#   {"tool":"strata-exec","threads":T,"prompt":P,"n":N,"prefill_tok_s":[...],"decode_tok_s":[...]}
# Threads: rayon uses every core unless RAYON_NUM_THREADS is set.
set -euo pipefail

if [[ $# -lt 2 ]]; then
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
    exit 1
fi
EXEC=$1
MODEL=$2
P=${3:-64}
N=${4:-32}
REPS=${5:-3}
PLAN_BIN=${STRATA_PLAN:-$(dirname "$EXEC")/strata-plan}
UBATCH=${UBATCH:-64}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
[[ -x $EXEC ]] || { echo "bench_cpu.sh: $EXEC is not an executable strata-exec" >&2; exit 1; }
[[ -x $PLAN_BIN ]] || { echo "bench_cpu.sh: $PLAN_BIN is not an executable strata-plan (set STRATA_PLAN)" >&2; exit 1; }
[[ -e $MODEL ]] || { echo "bench_cpu.sh: no model at $MODEL" >&2; exit 1; }

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
PLAN=$TMP/bench.plan
CTX=$(( P + N + 8 ))
"$PLAN_BIN" --hardware "$ROOT/plans/hardware/cpu.toml" --gpu 0 --model "$MODEL" \
    --max-context "$CTX" --ubatch "$UBATCH" --kv f16 -o "$PLAN" --format json > "$TMP/report.json"

# A fixed prompt of P ids (7, 14, 21, ... mod 200): the same one bench_cpu_torch.py uses.
PROMPT=$(python3 -c "print(','.join(str((7 * (i + 1)) % 200) for i in range($P)))")
THREADS=${RAYON_NUM_THREADS:-$(nproc)}
PRE=()
DEC=()
for r in $(seq 1 "$REPS"); do
    J=$("$EXEC" "$PLAN" --prompt-tokens "$PROMPT" -n "$N" --ignore-eos --format json -q)
    echo "$J" | python3 -c "
import json, sys
j = json.load(sys.stdin)
t = j['timings']
print(json.dumps({'run': $r, 'prefill_tok_s': round(t['prefill_tok_s'], 2), 'decode_tok_s': round(t['decode_tok_s'], 2), 'load_s': round(t['load_s'], 2)}))
" | tee "$TMP/run$r.json"
done
python3 - "$TMP" "$REPS" "$THREADS" "$P" "$N" "$MODEL" <<'PY'
import json, statistics, sys
tmp, reps, threads, p, n, model = sys.argv[1:]
runs = [json.load(open(f"{tmp}/run{r}.json")) for r in range(1, int(reps) + 1)]
pre = [x["prefill_tok_s"] for x in runs]
dec = [x["decode_tok_s"] for x in runs]
print(json.dumps({
    "tool": "strata-exec", "model": model, "threads": int(threads), "prompt": int(p), "n": int(n),
    "prefill_tok_s": pre, "decode_tok_s": dec,
    "prefill_median": statistics.median(pre), "decode_median": statistics.median(dec),
}))
PY
