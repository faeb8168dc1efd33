#!/usr/bin/env python3
"""Replay a multi-turn chat against a running `strata-exec PLAN --serve` and report its
time to first token (the server's own `strata_time_to_first_token_seconds`, arrival to the
first sampled token) with the prefix-cache counters: each turn sends every earlier message,
the answers, and a new user message, greedy, as a chat client does. Standard library only.

    python3 scripts/prefix_replay.py --url http://127.0.0.1:8080 [--turns 8] [--max-tokens 16]
        [--elide-answers]

`--elide-answers` sends a fixed stand-in back instead of each answer (a client that strips or
edits replies): the next prompt then shares the previous prompt but not the answer, so a
Qwen3-Next server can hit only its slots' prefix checkpoints.

Run it once against a server started normally and once against one started with
`--no-prefix-cache`; the answers' digest must be the same (the cache does not change greedy
output) and the TTFT ratio is the gain (BENCHMARKS.md, issue 22).
"""
import argparse
import hashlib
import json
import time
import urllib.request


def get(url):
    with urllib.request.urlopen(url, timeout=600) as r:
        return r.read().decode()


def metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise SystemExit(f"no {name} in /metrics")


def post(url, body):
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def user_message(turn, words):
    # Varied, deterministic text (a real chat's new message each turn).
    pool = ("the river under old stone bridges carries light and quiet boats toward "
            "a harbour where gulls argue over nets while the town wakes slowly").split()
    return " ".join(pool[(turn * 7 + i * 3) % len(pool)] for i in range(words)) + "?"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--user-words", type=int, default=60)
    ap.add_argument("--elide-answers", action="store_true",
                    help="send '(answer elided)' back instead of each answer")
    a = ap.parse_args()
    m0 = get(a.url + "/metrics")
    messages, answers, walls, prompts = [], [], [], []
    for t in range(a.turns):
        messages.append({"role": "user", "content": user_message(t, a.user_words)})
        t0 = time.perf_counter()
        r = post(a.url + "/v1/chat/completions", {
            "messages": messages, "max_tokens": a.max_tokens, "temperature": 0})
        walls.append(time.perf_counter() - t0)
        text = r["choices"][0]["message"]["content"]
        prompts.append(r["usage"]["prompt_tokens"])
        answers.append(text)
        sent = "(answer elided)" if a.elide_answers else text
        messages.append({"role": "assistant", "content": sent})
    m1 = get(a.url + "/metrics")
    d = lambda n: metric(m1, n) - metric(m0, n)
    n = d("strata_time_to_first_token_seconds_count")
    ttft = d("strata_time_to_first_token_seconds_sum") / max(n, 1)
    out = {
        "turns": a.turns,
        "prompt_tokens_per_turn": prompts,
        "mean_ttft_ms": round(ttft * 1e3, 3),
        "mean_request_ms": round(sum(walls) / len(walls) * 1e3, 3),
        "prefix_cache_hits": d("strata_prefix_cache_hits_total"),
        "checkpoint_hits": d("strata_prefix_cache_checkpoint_hits_total"),
        "reused_tokens": d("strata_prefix_cache_reused_tokens_total"),
        "prefilled_tokens": d("strata_prompt_tokens_total"),
        "answers_sha256": hashlib.sha256(json.dumps(answers).encode()).hexdigest()[:16],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
