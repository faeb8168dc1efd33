#!/usr/bin/env python3
"""Load a running `strata-exec PLAN --serve` (or any OpenAI-compatible server) with N
concurrent streamed completions and report what each client sees: time to first token and
inter-token latency (p50 / p95 / max over every request and token), end-to-end time, and the
aggregate decode rate. Standard library only; one thread per client.

    python3 scripts/serve_load.py --url http://127.0.0.1:8080 --clients 1,4,16 \\
        [--prompt-tokens 512] [--max-tokens 128] [--requests 2] [--temperature 0]
        [--format text|json]

Each client sends `--requests` requests one after another, each a prompt of about
`--prompt-tokens` tokens (distinct words per client and request, so no prefix is shared)
and `max_tokens` of greedy completion with `ignore_eos`, streamed. A gap is the time between
two streamed chunks with text (a token whose text is empty, such as a character's first
bytes, joins the next one); the token count is the stream's `usage`. Latencies are measured at the client, so they include the HTTP and
detokenizer overhead a user sees. The numbers are for the README's "what to expect under
load" and BENCHMARKS.md (issue 20); every figure comes with the command that made it.
"""
import argparse
import json
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request

WORDS = ("amber basin cobalt delta ember fjord granite harbor inlet juniper kestrel lagoon "
         "meadow nectar orchard prairie quartz ridge summit tundra upland valley willow "
         "yarrow zephyr").split()


def prompt(client, request, n_words):
    # Distinct from the first word on, so the prefix cache cannot share anything.
    head = f"client {client} request {request}:"
    body = " ".join(WORDS[(client * 7 + request * 13 + i * 5) % len(WORDS)] for i in range(n_words))
    return f"{head} {body}"


def model_id(url):
    with urllib.request.urlopen(url + "/v1/models", timeout=60) as r:
        return json.loads(r.read())["data"][0]["id"]


def one_request(url, model, text, max_tokens, temperature=0.0, seed=0):
    """(ttft_s, [gaps_s], e2e_s, tokens) of one streamed completion."""
    body = {
        "model": model, "prompt": text, "max_tokens": max_tokens, "temperature": temperature,
        "seed": seed, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    first, last, gaps, tokens, usage = None, None, [], 0, None
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"].get("completion_tokens")
            if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                continue
            now = time.perf_counter()
            tokens += 1
            if first is None:
                first = now
            else:
                gaps.append(now - last)
            last = now
    end = time.perf_counter()
    if first is None:
        raise RuntimeError("the stream carried no text")
    # The usage chunk counts tokens whose text was empty too (a character's first bytes).
    return first - t0, gaps, end - t0, usage if usage is not None else tokens


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def run_level(a, model, clients):
    results, errors = [], []
    lock = threading.Lock()

    def client(c):
        for r in range(a.requests):
            try:
                res = one_request(a.url, model, prompt(c, r, a.prompt_tokens), a.max_tokens,
                                  a.temperature, 1000 * c + r)
            except (urllib.error.URLError, RuntimeError, OSError, ValueError) as e:
                with lock:
                    errors.append(f"client {c} request {r}: {e}")
                return
            with lock:
                results.append(res)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit("serve_load.py: " + "; ".join(errors[:3]))
    ttft = [r[0] for r in results]
    gaps = [g for r in results for g in r[1]]
    e2e = [r[2] for r in results]
    tokens = sum(r[3] for r in results)
    return {
        "clients": clients,
        "requests": len(results),
        "prompt_words": a.prompt_tokens,
        "max_tokens": a.max_tokens,
        "ttft_ms": {k: 1e3 * pct(ttft, p) for k, p in (("p50", 50), ("p95", 95), ("max", 100))},
        "itl_ms": {k: 1e3 * pct(gaps, p) for k, p in (("p50", 50), ("p95", 95), ("max", 100))},
        "e2e_s_p50": statistics.median(e2e),
        "tokens": tokens,
        "aggregate_tok_s": tokens / wall,
        "wall_s": wall,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--clients", default="1,4",
                    help="comma-separated numbers of concurrent clients, one run each")
    ap.add_argument("--prompt-tokens", type=int, default=512,
                    help="words of each prompt (about one token each)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=2, help="requests per client, in turn")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature (0 = greedy; a random-weight model may need "
                         "> 0 so its streams carry text), seeded per client and request")
    ap.add_argument("--format", choices=["text", "json"], default="text")
    a = ap.parse_args()
    try:
        levels = [int(x) for x in a.clients.split(",") if x]
    except ValueError:
        sys.exit(f"serve_load.py: --clients takes numbers like 1,4,16, not `{a.clients}`")
    if not levels or min(levels) < 1:
        sys.exit("serve_load.py: --clients needs at least one number >= 1")
    model = model_id(a.url)
    rows = [run_level(a, model, n) for n in levels]
    if a.format == "json":
        for r in rows:
            print(json.dumps(r))
        return
    print(f"model {model}, prompts of ~{a.prompt_tokens} tokens, {a.max_tokens} tokens each, "
          f"{a.requests} request(s) per client")
    print("| clients | TTFT p50 / p95 ms | ITL p50 / p95 / max ms | e2e p50 s | aggregate tok/s |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        t, i = r["ttft_ms"], r["itl_ms"]
        print(f"| {r['clients']} | {t['p50']:.0f} / {t['p95']:.0f} | "
              f"{i['p50']:.1f} / {i['p95']:.1f} / {i['max']:.1f} | {r['e2e_s_p50']:.2f} | "
              f"{r['aggregate_tok_s']:.1f} |")


if __name__ == "__main__":
    main()
