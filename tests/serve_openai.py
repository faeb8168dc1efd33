#!/usr/bin/env python3
"""The `openai` Python client against a Strata server: chat and completion, streaming and
not, seeded sampling, stop sequences, logprobs and `n` choices, tools and
chat_template_kwargs (request side), structured output (`response_format` json_schema
answers valid against their schema in 100 of 100 sampled runs, checked with `jsonschema`),
and the error cases (context
overflow naming both numbers, unknown model, bad types, wrong API key with /health open,
malformed and oversized bodies), then SIGINT and exit 0 when this script started the server.

Modes:
  serve_openai.py [BIN]             strata-serve-test (TinyEngine, random weights; default:
                                    from the cargo target dir, or STRATA_SERVE_BIN)
  serve_openai.py --real            the real CPU engine: plans tests/data/tiny-chat-moe with
                                    the target dir's strata-plan for plans/hardware/cpu.toml
                                    and starts `strata-exec PLAN --serve`
  serve_openai.py --exec BIN --plan PLAN
                                    `BIN PLAN --serve` (any backend: the plan decides)
  serve_openai.py --url http://H:P  a server someone else started; it must have been started
                                    with --api-key test-key --model-name strata-tiny
                                    --max-body 65536 (override with --api-key/--model/--max-body)
Prints 'N passed, N failed' and exits non-zero on any failure.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.request

import openai

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK_DIR = os.path.join(ROOT, "tests", "data", "tiny-chat")
REAL_MODEL = os.path.join(ROOT, "tests", "data", "tiny-chat-moe")
KEY = "test-key"
MODEL = "strata-tiny"
MAX_BODY = 65536
CLEANUP = []


def target_bin(name):
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    for profile in ("release", "debug"):
        p = os.path.join(target, profile, name)
        if os.path.exists(p):
            return p
    sys.exit(f"{name} not found under {target}: build it with `cargo build -p strata-exec` "
             f"(and `-p strata-plan` for --real)")


def server_argv(args):
    """The command line that starts the server, or None in --url mode."""
    common = ["--port", "0", "--api-key", KEY, "--queue", "8", "--max-body", str(MAX_BODY)]
    if args.url:
        return None
    if args.real or args.exec:
        exe = args.exec or target_bin("strata-exec")
        plan = args.plan
        if plan is None:
            if not args.real:
                sys.exit("--exec needs --plan PLAN")
            tmp = tempfile.mkdtemp(prefix="strata-serve-openai-")
            CLEANUP.append(tmp)
            plan = os.path.join(tmp, "tiny-chat.plan")
            subprocess.run(
                [target_bin("strata-plan"), "--model", REAL_MODEL, "--hardware",
                 os.path.join(ROOT, "plans", "hardware", "cpu.toml"), "--gpu", "0",
                 "--max-context", "256", "--batch", "2", "--ubatch", "8", "-o", plan],
                check=True, stdout=subprocess.DEVNULL)
        return [exe, plan, "--serve", "-q", "--model-name", MODEL, "--shutdown-grace", "2"] + common
    binary = args.binary or os.environ.get("STRATA_SERVE_BIN") or target_bin("strata-serve-test")
    return [binary, "--tokenizer", TOK_DIR, "--slots", "2", "--ctx", "256", "--ubatch", "8",
            "--grace-ms", "2000"] + common


def start_server(argv):
    print("starting:", " ".join(argv), flush=True)
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    addr = None
    deadline = time.time() + 300
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        sys.stderr.write(line)
        if "http://" in line:
            addr = line.split("http://", 1)[1].split()[0].rstrip(":")
            break
    if addr is None:
        proc.kill()
        sys.exit("the server did not print its address")
    threading.Thread(target=lambda: [sys.stderr.write(l) for l in proc.stderr], daemon=True).start()
    wait_healthy(addr, deadline, proc)
    return proc, addr


def wait_healthy(addr, deadline, proc=None):
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            sys.exit(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://{addr}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.05)
    if proc is not None:
        proc.kill()
    sys.exit("the server never became healthy")


# Filled from /v1/models once the server is up.
META = {}


def raw(addr, path, body, method="POST", key=None):
    key = KEY if key is None else key
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
    assert META["n_slots"] >= 1 and META["max_context"] >= 64, META


@check
def models_retrieve_answers_the_served_name(client, addr):
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.created > 1_600_000_000, m
    try:
        client.models.retrieve("no-such-model")
        raise AssertionError("an unknown model id was retrieved")
    except openai.NotFoundError:
        pass


@check
def logit_bias_forces_a_token_and_penalties_are_deterministic(client, addr):
    code, out = raw(addr, "/tokenize", json.dumps({"content": " the"}).encode())
    assert code == 200, (code, out)
    tok = json.loads(out)["tokens"][-1]
    n = 5
    text = client.completions.create(model=MODEL, prompt="Hello", max_tokens=n, temperature=0,
                                     logit_bias={str(tok): 100}).choices[0].text
    code, out = raw(addr, "/detokenize", json.dumps({"tokens": [tok] * n}).encode())
    assert code == 200, (code, out)
    assert text == json.loads(out)["content"], (text, out)
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.8, seed=7,
              presence_penalty=1.0, frequency_penalty=0.5,
              extra_body={"min_p": 0.05, "repetition_penalty": 1.2})
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b, (a, b)
    msgs = [{"role": "user", "content": "Hi"}]
    c = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0,
                                       frequency_penalty=1.0)
    assert isinstance(c.choices[0].message.content, str)


@check
def unimplemented_output_changing_field_is_400_naming_it(client, addr):
    try:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                  extra_body={"best_of": 3})
        raise AssertionError("best_of was silently accepted")
    except openai.BadRequestError as e:
        assert "best_of" in str(e), e
    kw = dict(model=MODEL, prompt="Hi", max_tokens=6, temperature=0.9, seed=5,
              extra_body={"typical_p": 0.5})
    assert client.completions.create(**kw).choices[0].text == \
        client.completions.create(**kw).choices[0].text
    ok = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0,
                                   extra_body={"some_unknown_field": 1})
    assert ok.choices, ok


@check
def logprobs_in_both_shapes_and_streamed(client, addr):
    msgs = [{"role": "user", "content": "Hello there!"}]
    c = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens, (content, c.usage)
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3, e
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True), e
        assert e.top_logprobs[0].token == e.token, "greedy: the chosen token is the top one"
    assert bytes(b for e in content for b in e.bytes).decode("utf-8", "replace") == \
        c.choices[0].message.content
    parts = []
    for chunk in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6,
                                                temperature=0, logprobs=True, top_logprobs=3,
                                                stream=True):
        for ch in chunk.choices:
            if ch.logprobs and ch.logprobs.content:
                parts.extend(ch.logprobs.content)
    assert [(p.token, p.logprob) for p in parts] == [(e.token, e.logprob) for e in content]
    t = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5,
                                  temperature=0, logprobs=2)
    lp = t.choices[0].logprobs
    n = t.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n, lp
    assert all(x <= 0 for x in lp.token_logprobs) and lp.text_offset[0] == 0, lp
    try:
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, logprobs=True,
                                       top_logprobs=21)
        raise AssertionError("top_logprobs 21 was accepted")
    except openai.BadRequestError as e:
        assert "top_logprobs" in str(e), e


@check
def n_choices_are_seeded_and_streamed_with_their_index(client, addr):
    n = min(2, META["n_slots"])
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=11, n=n)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == list(range(n)), a
    assert [c.text for c in a.choices] == [c.text for c in b.choices], (a, b)
    for i, c in enumerate(a.choices):
        one = client.completions.create(**{**kw, "n": 1, "seed": 11 + i})
        assert one.choices[0].text == c.text, (i, one, c)
    msgs = [{"role": "user", "content": "Hi"}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6,
                                          temperature=0.8, seed=3, n=n)
    texts = [""] * n
    for chunk in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6,
                                                temperature=0.8, seed=3, n=n, stream=True):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == [c.message.content for c in full.choices], (texts, full)
    try:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, n=META["n_slots"] + 1)
        raise AssertionError("n over the slots was accepted")
    except openai.BadRequestError as e:
        assert "`n`" in str(e) and "--batch" in str(e), e


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
def tools_and_template_kwargs_are_accepted_and_checked(client, addr):
    # The test models write noise, not tool calls: this checks the request side and that
    # the shaped answer (tools on) streams the same text as it answers whole.
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=8, temperature=0, tools=tools,
              tool_choice="auto",
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    full = client.chat.completions.create(**kw)
    c = full.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls"), c
    if c.finish_reason != "tool_calls":
        assert isinstance(c.message.content, str) and not c.message.tool_calls, c
    parts = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            if ch.delta.content:
                parts.append(ch.delta.content)
    assert "".join(parts) == (c.message.content or ""), (parts, c.message.content)
    for bad, needle in (({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
                        ({"tools": tools, "tool_choice": {"type": "function",
                                                          "function": {"name": "nope"}}}, "nope")):
        try:
            client.chat.completions.create(model=MODEL, max_tokens=2,
                                           messages=[{"role": "user", "content": "x"}], **bad)
            raise AssertionError(f"{bad} was accepted")
        except openai.BadRequestError as e:
            assert needle in str(e), e


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
        assert "100000" in msg and str(META["max_context"]) in msg, msg
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
    for body, status in ((b"{oops", 400), (b'{"prompt": "\xff"}', 400), (b"x" * (MAX_BODY + 10), 413),
                         (b'{"prompt": "hi", "max_tokens": 1e400}', 400), (b'{"prompt": [1, -1]}', 400)):
        code, out = raw(addr, "/v1/completions", body)
        assert code == status, (body[:30], code, out[:200])
        err = json.loads(out)["error"]
        assert err["message"] and err["type"], err
        ok = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
        assert ok.choices[0].finish_reason in ("stop", "length")


@check
def token_id_prompt_streams_usage_in_the_last_chunk(client, addr):
    prompt = [1, 17, 42, 5]
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    assert full.usage.prompt_tokens == 4, full.usage
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and not chunks[-1].choices, chunks[-1]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert "".join(c.choices[0].text for c in chunks[:-1]) == full.choices[0].text


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


@check
def structured_output_is_valid_json_against_its_schema_100_of_100(client, addr):
    # The model's weights are random: only the constraint makes this JSON at all.
    import jsonschema
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    bad = []
    for seed in range(100):
        if seed % 2:
            r = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "A person as JSON"}],
                max_tokens=200, temperature=1.0, seed=seed, response_format=fmt)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        else:
            r = client.completions.create(model=MODEL, prompt="Person:", max_tokens=200,
                                          temperature=1.0, seed=seed,
                                          extra_body={"response_format": fmt})
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        try:
            jsonschema.validate(json.loads(text), PERSON)
            assert finish == "stop", finish
        except Exception as e:
            bad.append(f"seed {seed}: {e}: {text!r}")
    assert not bad, f"{len(bad)} of 100 invalid:\n" + "\n".join(bad[:5])
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "{"}],
                                       max_tokens=120, temperature=0.7, seed=1,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict), r
    try:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}})
        raise AssertionError("a schema llguidance rejects was accepted")
    except openai.BadRequestError as e:
        assert "response_format" in str(e), e


@check
def structured_output_with_bias_penalties_and_min_p_batched_with_others(client, addr):
    # Constrained requests that also carry logit_bias, the penalties and min_p, sent at once
    # with unconstrained ones whose +100 bias forces a token: the engine processes each row
    # of the mixed batches where it picks (on the GPU where it samples there), and every
    # document still validates while the forced requests repeat their token.
    import jsonschema
    from concurrent.futures import ThreadPoolExecutor
    code, out = raw(addr, "/tokenize", json.dumps({"content": " the"}).encode())
    assert code == 200, (code, out)
    tok = json.loads(out)["tokens"][-1]
    code, out = raw(addr, "/detokenize", json.dumps({"tokens": [tok] * 5}).encode())
    assert code == 200, (code, out)
    forced = json.loads(out)["content"]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def one(i):
        if i % 3 == 2:
            r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5,
                                          temperature=1.0, seed=i, logit_bias={str(tok): 100})
            return "forced", r.choices[0].text, r.choices[0].finish_reason
        r = client.completions.create(
            model=MODEL, prompt="Person:", max_tokens=200, temperature=1.0 if i % 3 else 0.0,
            seed=i, presence_penalty=0.5, frequency_penalty=0.3, logit_bias={str(tok): -100},
            extra_body={"response_format": fmt, "min_p": 0.05, "repetition_penalty": 1.2})
        return "json", r.choices[0].text, r.choices[0].finish_reason

    with ThreadPoolExecutor(max_workers=8) as ex:
        results = list(ex.map(one, range(24)))
    for i, (kind, text, finish) in enumerate(results):
        if kind == "forced":
            assert text == forced, (i, text, forced)
        else:
            jsonschema.validate(json.loads(text), PERSON)
            assert finish == "stop", (i, finish, text)


@check
def metrics_expose_the_issue_families(client, addr):
    code, out = raw(addr, "/metrics", None, method="GET")
    assert code == 200
    text = out.decode()
    for name in ("strata_requests_running ", "strata_requests_queued ", "strata_prompt_tokens_total ",
                 "strata_generated_tokens_total ", "strata_tokens_per_second ",
                 "strata_expert_cache_hits_total ", "strata_expert_cache_misses_total ",
                 'strata_kv_cells_in_use{slot="0"} '):
        assert name in text, (name, text)
    gen = float(next(l.split()[1] for l in text.splitlines() if l.startswith("strata_generated_tokens_total ")))
    assert gen > 0, text


@check
def tokenize_detokenize_and_slots(client, addr):
    code, out = raw(addr, "/tokenize", json.dumps({"content": "Hello there"}).encode())
    assert code == 200
    toks = json.loads(out)["tokens"]
    code, out = raw(addr, "/detokenize", json.dumps({"tokens": toks}).encode())
    assert json.loads(out)["content"] == "Hello there"
    code, out = raw(addr, "/slots", None, method="GET")
    slots = json.loads(out)
    assert len(slots) == META["n_slots"] and all(s["state"] == "idle" for s in slots), slots


def main():
    global KEY, MODEL, MAX_BODY
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("binary", nargs="?", help="strata-serve-test binary (default mode)")
    ap.add_argument("--real", action="store_true", help="plan tests/data/tiny-chat-moe and serve it with strata-exec")
    ap.add_argument("--exec", metavar="BIN", help="a strata-exec binary to start with --plan")
    ap.add_argument("--plan", metavar="PLAN", help="the plan for --exec")
    ap.add_argument("--url", help="attach to a running server, e.g. http://127.0.0.1:8080")
    ap.add_argument("--api-key", default=KEY)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--max-body", type=int, default=MAX_BODY)
    args = ap.parse_args()
    KEY, MODEL, MAX_BODY = args.api_key, args.model, args.max_body
    argv = server_argv(args)
    if argv is None:
        proc, addr = None, args.url.split("://", 1)[-1].rstrip("/")
        wait_healthy(addr, time.time() + 300)
    else:
        proc, addr = start_server(argv)
    code, out = raw(addr, "/v1/models", None, method="GET")
    assert code == 200, (code, out)
    META.update(json.loads(out)["data"][0]["meta"])
    print(f"server {addr}: {META}", flush=True)
    client = openai.OpenAI(base_url=f"http://{addr}/v1", api_key=KEY, max_retries=0, timeout=120)
    passed = failed = 0
    try:
        for fn in CHECKS:
            try:
                fn(client, addr)
                passed += 1
                print(f"ok   {fn.__name__}", flush=True)
            except Exception:
                failed += 1
                print(f"FAIL {fn.__name__}", flush=True)
                traceback.print_exc()
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = None
    if proc is not None:
        if code == 0:
            passed += 1
            print("ok   sigint_exits_zero")
        else:
            failed += 1
            print(f"FAIL sigint_exits_zero (exit code {code})")
    for d in CLEANUP:
        shutil.rmtree(d, ignore_errors=True)
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
