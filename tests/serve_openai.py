#!/usr/bin/env python3
"""The `openai` Python client against a running Strata server.

Starts the server binary (default: strata-serve-test from the cargo target dir; override with
STRATA_SERVE_BIN or argv[1]) on a free loopback port over the tiny test model and the
tests/data/tiny-chat tokenizer, waits for /health, runs chat and completion requests
(streaming and not) and the error cases, then stops it with SIGINT and expects exit 0.
Prints 'N passed, N failed' and exits non-zero on any failure.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request

import openai

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK_DIR = os.path.join(ROOT, "tests", "data", "tiny-chat")
KEY = "test-key"
MODEL = "strata-tiny"


def find_binary():
    if len(sys.argv) > 1:
        return sys.argv[1]
    if os.environ.get("STRATA_SERVE_BIN"):
        return os.environ["STRATA_SERVE_BIN"]
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    for profile in ("release", "debug"):
        p = os.path.join(target, profile, "strata-serve-test")
        if os.path.exists(p):
            return p
    sys.exit("strata-serve-test not found: build it with `cargo build -p strata-exec --bin strata-serve-test`")


def start_server(binary):
    proc = subprocess.Popen(
        [binary, "--tokenizer", TOK_DIR, "--port", "0", "--api-key", KEY, "--slots", "2",
         "--ctx", "256", "--ubatch", "8", "--queue", "8", "--max-body", "65536", "--grace-ms", "2000"],
        stderr=subprocess.PIPE, text=True,
    )
    addr = None
    deadline = time.time() + 120
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        if "http://" in line:
            addr = line.split("http://", 1)[1].strip()
            break
    if addr is None:
        proc.kill()
        sys.exit("the server did not print its address")
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://{addr}/health", timeout=5) as r:
                if r.status == 200:
                    return proc, addr
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.05)
    proc.kill()
    sys.exit("the server never became healthy")


def raw(addr, path, body, method="POST", key=KEY):
    req = urllib.request.Request(f"http://{addr}{path}", data=body, method=method)
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


@check
def models_list(client, addr):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL], ids


@check
def completion_non_streaming_and_streaming_agree(client, addr):
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    full = client.completions.create(**kw)
    assert full.object == "text_completion"
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.prompt_tokens > 0 and 0 < full.usage.completion_tokens <= 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    parts, finish = [], None
    for chunk in client.completions.create(stream=True, **kw):
        parts.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(parts) == full.choices[0].text, (parts, full.choices[0].text)
    assert finish == full.choices[0].finish_reason


@check
def chat_non_streaming_and_streaming_agree_with_usage(client, addr):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there!"}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    text = full.choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage, roles = [], None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            if c.delta.content:
                parts.append(c.delta.content)
    assert roles == ["assistant"], roles
    assert "".join(parts) == text, (parts, text)
    assert usage is not None and usage.prompt_tokens == full.usage.prompt_tokens
    assert usage.completion_tokens == full.usage.completion_tokens


@check
def seeded_sampling_is_reproducible(client, addr):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


@check
def stop_sequences_cut_the_text(client, addr):
    base = client.completions.create(model=MODEL, prompt="Hello", max_tokens=24, temperature=0).choices[0].text
    cands = [base[i:i + 2] for i in range(1, len(base) - 1) if "\ufffd" not in base[i:i + 2]]
    if not cands:
        raise AssertionError(f"no clean two-character piece to stop on in {base!r}")
    stop = cands[0]
    for stream in (False, True):
        kw = dict(model=MODEL, prompt="Hello", max_tokens=24, temperature=0, stop=[stop])
        if stream:
            parts, finish = [], None
            for chunk in client.completions.create(stream=True, **kw):
                parts.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            text = "".join(parts)
        else:
            cut = client.completions.create(**kw)
            text, finish = cut.choices[0].text, cut.choices[0].finish_reason
        assert finish == "stop", (stream, finish)
        assert text == base[:base.index(stop)], (stream, text, base, stop)


@check
def context_overflow_is_400_naming_both_numbers(client, addr):
    try:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=100000)
    except openai.BadRequestError as e:
        msg = e.body["message"] if isinstance(e.body, dict) else str(e)
        assert "100000" in msg and "256" in msg, msg
    else:
        raise AssertionError("no error")


@check
def unknown_model_is_404(client, addr):
    try:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    except openai.NotFoundError as e:
        assert "gpt-4o" in str(e)
    else:
        raise AssertionError("no error")


@check
def empty_messages_and_bad_types_are_400(client, addr):
    for kw in (dict(messages=[]), dict(messages=[{"role": "user", "content": "x"}], temperature=-1),
               dict(messages=[{"role": "user", "content": "x"}], max_tokens=-3)):
        try:
            client.chat.completions.create(model=MODEL, **kw)
        except openai.BadRequestError:
            pass
        else:
            raise AssertionError(f"no error for {kw}")


@check
def wrong_key_is_401_and_health_stays_open(client, addr):
    bad = openai.OpenAI(base_url=f"http://{addr}/v1", api_key="wrong", max_retries=0)
    try:
        bad.models.list()
    except openai.AuthenticationError:
        pass
    else:
        raise AssertionError("no error")
    with urllib.request.urlopen(f"http://{addr}/health", timeout=5) as r:
        assert r.status == 200


@check
def raw_bad_bodies_get_json_errors_and_the_server_goes_on(client, addr):
    for body, status in ((b"{oops", 400), (b'{"prompt": "\xff"}', 400), (b"x" * 70000, 413),
                         (b'{"prompt": "hi", "max_tokens": 1e400}', 400), (b'{"prompt": [1, -1]}', 400)):
        code, out = raw(addr, "/v1/completions", body)
        assert code == status, (body[:30], code, out[:200])
        err = json.loads(out)["error"]
        assert err["message"] and err["type"], err
        ok = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
        assert ok.choices[0].finish_reason in ("stop", "length")


@check
def tokenize_detokenize_and_slots(client, addr):
    code, out = raw(addr, "/tokenize", json.dumps({"content": "Hello there"}).encode())
    assert code == 200
    toks = json.loads(out)["tokens"]
    code, out = raw(addr, "/detokenize", json.dumps({"tokens": toks}).encode())
    assert json.loads(out)["content"] == "Hello there"
    code, out = raw(addr, "/slots", None, method="GET")
    slots = json.loads(out)
    assert len(slots) == 2 and all(s["state"] == "idle" for s in slots), slots


def main():
    binary = find_binary()
    proc, addr = start_server(binary)
    client = openai.OpenAI(base_url=f"http://{addr}/v1", api_key=KEY, max_retries=0, timeout=60)
    passed = failed = 0
    try:
        for fn in CHECKS:
            try:
                fn(client, addr)
                passed += 1
                print(f"ok   {fn.__name__}")
            except Exception:
                failed += 1
                print(f"FAIL {fn.__name__}")
                traceback.print_exc()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = None
    if code == 0:
        passed += 1
        print("ok   sigint_exits_zero")
    else:
        failed += 1
        print(f"FAIL sigint_exits_zero (exit code {code})")
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
