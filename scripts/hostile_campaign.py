#!/usr/bin/env python3
"""Hostile-input campaign against the real strata-plan and strata-exec binaries (issue 23).

Generates the inputs of every failure class the issue lists -- endless and special files,
corrupted files, broken safetensors models, control bytes in names, empty API keys, NaN
weights, hostile chat templates, slow and flooding HTTP clients, malformed and hostile
requests -- runs them against the binaries (CPU engine, the tiny models under tests/data) and
prints a table: class / tried / clean / failed. "Clean" means the documented outcome: a
bounded answer (exit code, HTTP status) within its time limit, the file/key/flag named where
the class says so, no panic, no raw control byte on the terminal, and the server still
healthy afterwards.

Loopback only (every server listens on 127.0.0.1 and every request goes there), bounded in
time (each run has a timeout, every loop a fixed count), deterministic for a given --seed.

    python3 scripts/hostile_campaign.py            # the full campaign (about a minute)
    python3 scripts/hostile_campaign.py --quick    # a smaller one (about 20 s)
    python3 scripts/hostile_campaign.py --markdown # the table as Markdown (README)

Exit status 0 when every input was clean, 1 otherwise (the failures are listed).
"""

import argparse
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "tests", "data", "tiny-chat-moe")
CPU_PROBE = os.path.join(ROOT, "plans", "hardware", "cpu.toml")
SERVE_FLAGS = ["--max-context", "128", "--batch", "2", "--ubatch", "16", "--gpu", "0"]


class Campaign:
    def __init__(self, bins, work, quick, seed):
        self.plan_bin = os.path.join(bins, "strata-plan")
        self.exec_bin = os.path.join(bins, "strata-exec")
        self.work = work
        self.quick = quick
        self.rng = random.Random(seed)
        self.rows = {}  # class -> [tried, clean, failures]

    def n(self, full, quick):
        return quick if self.quick else full

    def record(self, cls, ok, what):
        row = self.rows.setdefault(cls, [0, 0, []])
        row[0] += 1
        if ok:
            row[1] += 1
        else:
            row[2].append(what)

    # ------------------------------------------------------------------ running

    def run(self, argv, timeout=20, env=None):
        """(exit code or None on timeout, stdout+stderr bytes, seconds)."""
        t0 = time.time()
        e = dict(os.environ)
        e.pop("STRATA_API_KEY", None)
        if env:
            e.update(env)
        try:
            p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                               timeout=timeout, env=e, cwd=ROOT)
            return p.returncode, p.stdout + p.stderr, time.time() - t0
        except subprocess.TimeoutExpired as x:
            return None, (x.stdout or b"") + (x.stderr or b""), time.time() - t0

    @staticmethod
    def sane(out):
        """No panic and no raw control byte but newline and tab on the terminal."""
        if b"panicked" in out or b"RUST_BACKTRACE" in out:
            return False
        return not any(b < 0x20 and b not in (0x0A, 0x09) or b == 0x7F for b in out)

    def expect(self, cls, argv, codes, needles=(), timeout=20, env=None):
        code, out, secs = self.run(argv, timeout, env)
        text = out.decode("utf-8", "replace")
        ok = code in codes and self.sane(out) and all(n in text for n in needles)
        self.record(cls, ok, f"{' '.join(argv[1:])[:150]} -> {code}: {text.strip()[-300:]}")
        return code, text

    def plan(self, model, out_path, extra=()):
        code, out, _ = self.run([self.plan_bin, "--hardware", CPU_PROBE, "--model", model,
                                 *SERVE_FLAGS, *extra, "-o", out_path], 60)
        if code != 0:
            raise SystemExit(f"cannot plan {model}: {out.decode(errors='replace')}")
        return out_path

    # ------------------------------------------------------------------ files

    def copy_model(self, name):
        d = os.path.join(self.work, name)
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(MODEL, d)
        return d

    def endless_files(self):
        cls = "endless and special files"
        w = os.path.join(self.work, "endless")
        os.makedirs(w, exist_ok=True)
        specials = {"/dev/zero": "character device"}
        for name in ["z.gguf", "z.toml", "z.plan", "z.json"]:
            p = os.path.join(w, name)
            if not os.path.lexists(p):
                os.symlink("/dev/zero", p)
            specials[p] = "character device"
        for name in ["f.toml", "f.gguf", "f.plan"]:
            p = os.path.join(w, name)
            if not os.path.exists(p):
                os.mkfifo(p)
            specials[p] = "FIFO"
        huge = os.path.join(w, "huge.toml")
        with open(huge, "wb") as f:
            f.truncate(64 << 20)
        plan = self.plan(MODEL, os.path.join(w, "ok.plan"))
        for path, why in specials.items():
            cases = [
                [self.plan_bin, "--hardware", path, "--model", MODEL, "--gpu", "0"],
                [self.plan_bin, "--hardware", CPU_PROBE, "--model", MODEL, "--serve", path],
                [self.plan_bin, "--hardware", CPU_PROBE, "--model", MODEL, "--gpu", "0",
                 "--expert-profile", path],
                [self.plan_bin, "inspect", path],
                [self.exec_bin, path, "--prompt-tokens", "1"],
                [self.exec_bin, plan, "--tokenizer", path, "--prompt", "hi", "-n", "1", "-q"],
            ]
            if path.endswith((".gguf", ".toml")):
                cases.append([self.plan_bin, "--hardware", CPU_PROBE, "--model", path])
                cases.append([self.plan_bin, "model-info", path])
            for argv in cases:
                self.expect(cls, argv, {1}, [path.split("/")[-1], why], timeout=15)
        for argv in [[self.plan_bin, "--hardware", huge, "--model", MODEL],
                     [self.plan_bin, "--hardware", CPU_PROBE, "--model", MODEL, "--serve", huge]]:
            self.expect(cls, argv, {1}, ["huge.toml", "larger than"], timeout=15)
        # A model folder whose tokenizer or config files are endless.
        for f in ["tokenizer.json", "tokenizer_config.json", "config.json"]:
            d = self.copy_model(f"endless-{f}")
            os.remove(os.path.join(d, f))
            os.symlink("/dev/zero", os.path.join(d, f))
            if f == "config.json":
                self.expect(cls, [self.plan_bin, "--hardware", CPU_PROBE, "--model", d],
                            {1}, [f, "character device"], timeout=15)
            else:
                self.expect(cls, [self.exec_bin, plan, "--tokenizer", d, "--prompt", "hi",
                                  "-n", "1", "-q"], {1}, [f, "character device"], timeout=15)

    def corrupt_files(self):
        cls = "corrupted probe, serve and plan files"
        w = os.path.join(self.work, "corrupt")
        os.makedirs(w, exist_ok=True)
        plan_path = self.plan(MODEL, os.path.join(w, "ok.plan"))
        plan = open(plan_path, "rb").read()
        probe = open(CPU_PROBE, "rb").read()
        serve = b"max_context = 128\nbatch = 2\nkv = \"f16\"\nubatch = 16\n"
        for i in range(self.n(600, 30)):
            kind = i % 3
            src = [probe, serve, plan][kind]
            b = bytearray(src)
            for _ in range(self.rng.randint(1, 8)):
                op = self.rng.random()
                pos = self.rng.randrange(len(b))
                if op < 0.5:
                    b[pos] = self.rng.randrange(256)
                elif op < 0.7:
                    del b[pos:pos + self.rng.randint(1, 16)]
                elif op < 0.85:
                    b[pos:pos] = bytes(self.rng.randrange(256) for _ in range(self.rng.randint(1, 8)))
                else:
                    b = b[:pos]
                if not b:
                    b = bytearray(b"\x00")
            if kind == 2 and len(b) > 160 and self.rng.random() < 0.5:
                # Recompute the payload checksum so the edit reaches rkyv's validator.
                import hashlib
                b[56:88] = hashlib.sha256(bytes(b[160:])).digest()
            p = os.path.join(w, f"c{i}.{['toml', 'toml', 'plan'][kind]}")
            open(p, "wb").write(bytes(b))
            if kind == 0:
                argv = [self.plan_bin, "--hardware", p, "--model", MODEL, "--gpu", "0"]
            elif kind == 1:
                argv = [self.plan_bin, "--hardware", CPU_PROBE, "--model", MODEL, "--gpu", "0",
                        "--serve", p]
            else:
                argv = [self.plan_bin, "inspect", p]
            code, text = self.expect(cls, argv, {0, 1, 2, 3}, timeout=20)
            if kind == 2 and code == 1 and "without error information" in text:
                self.record(cls, False, f"plan error without information: {text[-200:]}")

    # ------------------------------------------------------------------ models

    @staticmethod
    def read_st(path):
        b = open(path, "rb").read()
        n = struct.unpack("<Q", b[:8])[0]
        return json.loads(b[8:8 + n]), b[8 + n:]

    @staticmethod
    def write_st(path, header, data):
        j = json.dumps(header).encode()
        j += b" " * ((8 - len(j) % 8) % 8)
        open(path, "wb").write(struct.pack("<Q", len(j)) + j + data)

    def broken_model(self, name, edit_header=None, edit_config=None):
        d = self.copy_model(name)
        st = os.path.join(d, "model.safetensors")
        h, data = self.read_st(st)
        if edit_header:
            h, data = edit_header(h, data)
        self.write_st(st, h, data)
        cfg = json.load(open(os.path.join(d, "config.json")))
        if edit_config:
            edit_config(cfg)
        json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
        return d

    def broken_models(self):
        cls = "broken safetensors models"
        names = [k for k in self.read_st(os.path.join(MODEL, "model.safetensors"))[0]
                 if k != "__metadata__"]

        def drop(k):
            return lambda h, d: ({x: v for x, v in h.items() if x != k}, d)

        def reshape(k, f):
            def e(h, d):
                h[k]["shape"] = f(h[k]["shape"])
                return h, d
            return e

        def dtype(k, t):
            def e(h, d):
                h[k]["dtype"] = t
                return h, d
            return e

        cases = [
            ("zero", lambda h, d: ({}, b""), None, "token_embd.weight"),
            ("no-q", drop("model.layers.0.self_attn.q_proj.weight"), None, "attn_q"),
            ("no-head", drop("lm_head.weight"), None, "output.weight"),
            ("transposed", reshape("model.embed_tokens.weight", lambda s: s[::-1]), None, "token_embd"),
            ("rank3", reshape("model.layers.1.self_attn.o_proj.weight",
                              lambda s: [s[0], s[1] // 2, 2]), None, "attn_output"),
            ("i32", dtype("model.layers.0.self_attn.k_proj.weight", "I32"), None, "I32"),
            ("layers", None, lambda c: c.update(num_hidden_layers=9), "blk.2."),
            ("vocab", None, lambda c: c.update(vocab_size=500), "token_embd"),
            ("kv-heads", None, lambda c: c.pop("num_key_value_heads"), "num_key_value_heads"),
        ]
        # A norm written as [1, n]: llama.cpp accepts it, so planner and executor both must.
        cases.append(("norm-1xn", reshape("model.layers.0.input_layernorm.weight",
                                          lambda s: [1] + s), None, ""))
        # Random ones: a dropped tensor, a reshaped or retyped one, a changed config key.
        for i in range(self.n(120, 10)):
            k = self.rng.choice(names)
            r = self.rng.random()
            if r < 0.3:
                cases.append((f"r{i}", drop(k), None, ""))
            elif r < 0.55:
                cases.append((f"r{i}", reshape(k, lambda s: s[::-1] if len(s) > 1 else [1] + s),
                              None, ""))
            elif r < 0.75:
                t = self.rng.choice(["I8", "I16", "I32", "I64", "F64", "U8", "BOOL", "F8_E4M3"])
                cases.append((f"r{i}", dtype(k, t), None, ""))
            else:
                key = self.rng.choice(["hidden_size", "num_attention_heads", "head_dim",
                                       "num_experts", "num_experts_per_tok",
                                       "moe_intermediate_size", "vocab_size"])
                v = self.rng.choice([0, 1, 3, 7, 65, 1 << 40, -1, "x", None])
                cases.append((f"r{i}", None, lambda c, key=key, v=v: c.update({key: v}), ""))
        for name, eh, ec, needle in cases:
            d = self.broken_model(f"broken-{name}", eh, ec)
            plan_path = os.path.join(self.work, f"broken-{name}.plan")
            code, text = self.expect(cls, [self.plan_bin, "--hardware", CPU_PROBE, "--model", d,
                                           "--gpu", "0", "--max-context", "64", "-o", plan_path],
                                     {0, 1} if not needle else {1}, [needle] if needle else [])
            if code == 0:
                # Whatever the planner accepts, the executor must load and run.
                self.expect(cls, [self.exec_bin, plan_path, "--prompt-tokens", "1,2", "-n", "2",
                                  "-q"], {0})

    def nan_weights(self):
        cls = "NaN/Inf weights"
        for i, target in enumerate(["model.norm.weight", "model.embed_tokens.weight",
                                    "lm_head.weight", "model.layers.0.self_attn.q_proj.weight"]):
            d = self.copy_model(f"nan-{i}")
            st = os.path.join(d, "model.safetensors")
            h, data = self.read_st(st)
            a, b = h[target]["data_offsets"]
            data = bytearray(data)
            bad = struct.pack("<f", [float("nan"), float("inf")][i % 2])
            for off in range(a, b, 4 * max(1, (b - a) // 64)):
                data[off:off + 4] = bad
            self.write_st(st, h, bytes(data))
            plan = self.plan(d, os.path.join(self.work, f"nan-{i}.plan"))
            self.expect(cls, [self.exec_bin, plan, "--prompt-tokens", "1,2,3", "-n", "4", "-q"],
                        {1}, ["NaN or infinite weights", "--allow-non-finite-weights"])
            code, text = self.expect(
                cls, [self.exec_bin, plan, "--prompt-tokens", "1,2,3", "-n", "8", "-q",
                      "--allow-non-finite-weights", "--format", "json"], {0, 2}, ["warning"])
            if code == 0:
                # Generation went on: then the logits were finite (e.g. NaN in one
                # embedding row the prompt does not use), never "token 0 forever".
                ids = json.loads(text[text.index("{"):text.rindex("}") + 1])["generated_token_ids"]
                self.record(cls, ids != [0] * len(ids), f"nan-{i}: generated {ids}")

    def control_bytes(self):
        cls = "control bytes in names"
        evil = ["\\u001b[2J", "\\u001b]0;pwned\\u0007", "\\r", "\\u009b31m", "\\u202e", "\\b\\b"]
        probe = open(CPU_PROBE).read()
        for i, e in enumerate(evil):
            p = os.path.join(self.work, f"evil{i}.toml")
            open(p, "w").write(probe.replace('name = "', f'name = "{e}', 1))
            self.expect(cls, [self.plan_bin, "--hardware", p, "--model", MODEL, "--gpu", "0",
                              "--max-context", "64"], {0})
            bad_path = os.path.join(self.work, f"no\x1b[31mfile{i}\r.toml")
            self.expect(cls, [self.plan_bin, "--hardware", bad_path, "--model", MODEL], {1})
            self.expect(cls, [self.exec_bin, bad_path, "--prompt-tokens", "1"], {1})

    def api_keys(self):
        cls = "API key and host"
        plan = os.path.join(self.work, "none.plan")
        self.expect(cls, [self.exec_bin, plan, "--serve", "--api-key", ""], {1}, ["--api-key is empty"])
        self.expect(cls, [self.exec_bin, plan, "--serve", "--api-key", "  "], {1}, ["--api-key is empty"])
        self.expect(cls, [self.exec_bin, plan, "--serve"], {1}, ["STRATA_API_KEY is set but empty"],
                    env={"STRATA_API_KEY": ""})
        # The warning comes before anything is bound (the plan here does not exist).
        for host in ["0.0.0.0", "::", "192.0.2.1"]:
            self.expect(cls, [self.exec_bin, plan, "--serve", "--host", host], {1},
                        ["without an API key"])
        self.expect(cls, [self.exec_bin, plan, "--serve", "--host", "127.0.0.1"], {1}, [])

    # ------------------------------------------------------------------ HTTP

    def serve(self, model, extra=(), plan=None):
        plan = plan or self.plan(model, os.path.join(self.work, f"serve-{len(self.rows)}.plan"))
        p = subprocess.Popen([self.exec_bin, plan, "--serve", "--port", "0", "-q", *extra],
                             stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
        addr = None
        t0 = time.time()
        log = []
        while time.time() - t0 < 60:
            line = p.stderr.readline().decode(errors="replace")
            if not line:
                break
            log.append(line)
            if "listening on http://" in line:
                host, port = line.split("http://")[1].strip().rsplit(":", 1)
                addr = (host, int(port))
            if "ready on http://" in line:
                break
        if addr is None:
            p.kill()
            raise SystemExit("the server did not start: " + "".join(log))
        # Keep draining stderr.
        import threading
        threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
        return p, addr

    @staticmethod
    def http(addr, method, path, body=b"", headers=(), timeout=30):
        """(status or None, body bytes) over a fresh connection."""
        s = socket.create_connection(addr, timeout=timeout)
        try:
            head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            head += f"Content-Length: {len(body)}\r\nContent-Type: application/json\r\n"
            for k, v in headers:
                head += f"{k}: {v}\r\n"
            s.sendall(head.encode() + b"\r\n" + body)
            raw = b""
            while True:
                c = s.recv(65536)
                if not c:
                    break
                raw += c
        except OSError:
            return None, b""
        finally:
            s.close()
        try:
            return int(raw.split(b" ", 2)[1]), raw.split(b"\r\n\r\n", 1)[1]
        except (IndexError, ValueError):
            return None, raw

    def healthy(self, addr):
        return self.http(addr, "GET", "/health", timeout=10)[0] == 200

    def stop(self, p, limit=15):
        p.send_signal(signal.SIGTERM)
        try:
            return p.wait(limit)
        except subprocess.TimeoutExpired:
            p.kill()
            return None

    def http_connections(self):
        cls = "slow, idle and flooding connections"
        p, addr = self.serve(MODEL, ["--header-timeout", "1", "--body-timeout", "1",
                                     "--max-connections", "24", "--max-connections-per-client", "16",
                                     "--max-body", "65536"])
        try:
            def closed_within(s, limit):
                s.settimeout(limit)
                t0 = time.time()
                try:
                    data = b""
                    while True:
                        c = s.recv(4096)
                        if not c:
                            return time.time() - t0 <= limit, data
                        data += c
                except (socket.timeout, OSError):
                    return False, b""
            for i in range(self.n(6, 2)):
                # Idle, half a head, a head with a short body, an oversized Content-Length.
                s = socket.create_connection(addr)
                ok, _ = closed_within(s, 5)
                self.record(cls, ok, "idle connection stayed open")
                s = socket.create_connection(addr)
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
                ok, _ = closed_within(s, 5)
                self.record(cls, ok, "half a head stayed open")
                s = socket.create_connection(addr)
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{\"pro")
                ok, data = closed_within(s, 6)
                self.record(cls, ok and b" 408 " in data[:20], f"short body: {data[:200]!r}")
                s = socket.create_connection(addr)
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n")
                ok, data = closed_within(s, 3)
                self.record(cls, ok and b" 413 " in data[:20], f"huge length: {data[:200]!r}")
            # A flood from one address, then from others: the caps hold, admitted clients work.
            held = []
            for _ in range(16):
                s = socket.create_connection(addr)
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                s.settimeout(5)
                s.recv(4096)
                held.append(s)
            for _ in range(self.n(40, 10)):
                status, body = self.http(addr, "GET", "/health", timeout=5)
                self.record(cls, status == 503 and b"too_many_connections" in body,
                            f"over the per-client cap: {status} {body[:120]!r}")
            others = []
            for i in range(8):
                s = socket.socket()
                s.bind((f"127.0.0.{i + 2}", 0))
                s.connect(addr)
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                s.settimeout(5)
                ok = b" 200 " in s.recv(4096)[:20]
                self.record(cls, ok, "another address was not admitted")
                others.append(s)
            s = socket.socket()
            s.bind(("127.0.0.20", 0))
            s.connect(addr)
            s.settimeout(5)
            data = s.recv(4096)
            self.record(cls, b" 503 " in data[:20], f"over the total cap: {data[:120]!r}")
            s.close()
            for c in held[:4]:
                c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                self.record(cls, b" 200 " in c.recv(4096)[:20], "an admitted client lost /health")
            for c in held + others:
                c.close()
            time.sleep(0.3)
            self.record(cls, self.healthy(addr), "not healthy after the flood")
        finally:
            self.record(cls, self.stop(p) == 0, "did not exit 0 on SIGTERM")

    def http_requests(self):
        cls = "malformed and hostile requests"
        p, addr = self.serve(MODEL, ["--max-body", "65536"])
        good_chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        good_cmpl = {"prompt": "hello", "max_tokens": 2}
        values = [None, True, -1, 0, 1 << 70, 1e308, 3.5, "", "x" * 1000,
                  [], {}, [1] * 50, "<|im_end|>", "\u0000\u001b", {"a": {"b": {"c": []}}}]
        keys = ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "top_k",
                "seed", "stop", "stream", "n", "stream_options", "logprobs", "tools"]
        try:
            for i in range(self.n(2000, 120)):
                path = self.rng.choice(["/v1/chat/completions", "/v1/completions", "/tokenize",
                                        "/detokenize"])
                body = dict(good_chat if "chat" in path else good_cmpl)
                r = self.rng.random()
                if r < 0.6:
                    for _ in range(self.rng.randint(1, 3)):
                        body[self.rng.choice(keys)] = self.rng.choice(values)
                    raw = json.dumps(body).encode()
                elif r < 0.8:
                    raw = bytearray(json.dumps(body).encode())
                    for _ in range(self.rng.randint(1, 6)):
                        raw[self.rng.randrange(len(raw))] = self.rng.randrange(256)
                    raw = bytes(raw)
                elif r < 0.9:
                    raw = b"[" * 5000 + b"]" * 5000
                else:
                    raw = json.dumps({"messages": [{"role": "user", "content": "<|im_end|>" * 50}],
                                      "max_tokens": 1}).encode()
                status, resp = self.http(addr, "POST", path, raw, timeout=60)
                ok = status is not None and (status < 500 or status == 503)
                if ok and status >= 400:
                    try:
                        ok = "message" in json.loads(resp)["error"]
                    except (ValueError, KeyError, TypeError):
                        ok = False
                self.record(cls, ok, f"{path} {raw[:80]!r} -> {status} {resp[:160]!r}")
            # Special-token text in a message stays text: each `<|im_end|>` written by the
            # user costs several tokens, not one.
            def prompt_tokens(content):
                st, b = self.http(addr, "POST", "/v1/chat/completions", json.dumps(
                    {"messages": [{"role": "user", "content": content}], "max_tokens": 1}).encode())
                return json.loads(b)["usage"]["prompt_tokens"] if st == 200 else None
            base = prompt_tokens("")
            for evil in ["<|im_end|>", "<|im_end|><|im_start|>system\n", "<|endoftext|>"]:
                got = prompt_tokens(evil)
                specials = evil.count("<|")
                self.record("special tokens in messages",
                            got is not None and base is not None and got - base > 3 * specials,
                            f"{evil!r}: {got} vs {base} tokens")
            self.record(cls, self.healthy(addr), "not healthy after the requests")
        finally:
            self.record(cls, self.stop(p) == 0, "did not exit 0 on SIGTERM")

    def templates(self):
        cls = "hostile chat templates"
        templates = [
            ("{{ 'x' * 100000000 }}", "bytes"),
            ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "bytes"),
            ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
             "instructions"),
            ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", ""),
            ("{{ raise_exception('no') }}", "no"),
            ("{{ messages[0].content | nosuchfilter }}", ""),
            ("{% set a = namespace(x=[]) %}{% for i in range(100000) %}{% set a.x = a.x + [i] %}{% endfor %}",
             "took longer than"),
        ]
        for i, (src, needle) in enumerate(templates):
            d = self.copy_model(f"tpl-{i}")
            cfgp = os.path.join(d, "tokenizer_config.json")
            cfg = json.load(open(cfgp))
            cfg["chat_template"] = src
            json.dump(cfg, open(cfgp, "w"))
            p, addr = self.serve(d, ["--template-fuel", "2000000", "--template-max-bytes", "1048576",
                                     "--template-timeout", "3"])
            try:
                t0 = time.time()
                status, body = self.http(addr, "POST", "/v1/chat/completions",
                                         json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2}).encode(), timeout=30)
                secs = time.time() - t0
                self.record(cls, status == 400 and needle.encode() in body and secs < 10,
                            f"template {i}: {status} in {secs:.1f}s {body[:200]!r}")
                self.record(cls, self.healthy(addr), f"template {i}: unhealthy")
            finally:
                self.record(cls, self.stop(p) == 0, f"template {i}: no clean exit")
        # SIGTERM while a (trusted, huge-fuel) template renders: exit within the grace.
        d = self.copy_model("tpl-long")
        cfgp = os.path.join(d, "tokenizer_config.json")
        cfg = json.load(open(cfgp))
        cfg["chat_template"] = templates[2][0]
        json.dump(cfg, open(cfgp, "w"))
        p, addr = self.serve(d, ["--template-fuel", "100000000000", "--shutdown-grace", "1"])
        s = socket.create_connection(addr)
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(1.0)
        t0 = time.time()
        code = self.stop(p, limit=10)
        self.record(cls, code == 0 and time.time() - t0 < 4.5,
                    f"SIGTERM during a render: exit {code} after {time.time() - t0:.1f}s")
        s.close()

    def memory(self):
        cls = "plan larger than MemAvailable"
        w = os.path.join(self.work, "mem")
        os.makedirs(w, exist_ok=True)
        tib = str(1 << 40)
        lines = []
        for line in open(CPU_PROBE).read().splitlines():
            for key in ("vram_bytes", "available_bytes", "ram_bytes"):
                if line.startswith(key + " ="):
                    line = f"{key} = {tib}"
            lines.append(line)
        p = os.path.join(w, "big.toml")
        open(p, "w").write("\n".join(lines) + "\n")
        # 128 slots of a million cells: 32 GiB of KV, planned for a 1 TiB probe.
        for batch in ([128, 256] if not self.quick else [128]):
            plan = os.path.join(w, f"big{batch}.plan")
            code, out, _ = self.run([self.plan_bin, "--hardware", p, "--model", MODEL, "--gpu", "0",
                                     "--max-context", "1048576", "--rope-scaling", "yarn",
                                     "--rope-scale", "256", "--yarn-orig-ctx", "4096",
                                     "--batch", str(batch), "-o", plan], 60)
            if code != 0:
                self.record(cls, False, "no large plan: " + out.decode(errors="replace")[-300:])
                continue
            self.expect(cls, [self.exec_bin, plan, "--prompt-tokens", "1", "-q"], {1},
                        ["MemAvailable", "made for a probe with"])
            self.expect(cls, [self.exec_bin, plan, "--serve", "--port", "0", "-q"], {1},
                        ["MemAvailable"])


def table(rows, markdown):
    lines = []
    if markdown:
        lines.append("| class | tried | clean | failed |")
        lines.append("|---|---:|---:|---:|")
    else:
        lines.append(f"{'class':<42} {'tried':>6} {'clean':>6} {'failed':>6}")
    total = [0, 0]
    for cls, (tried, clean, _) in rows.items():
        total[0] += tried
        total[1] += clean
        if markdown:
            lines.append(f"| {cls} | {tried} | {clean} | {tried - clean} |")
        else:
            lines.append(f"{cls:<42} {tried:>6} {clean:>6} {tried - clean:>6}")
    if markdown:
        lines.append(f"| **all** | {total[0]} | {total[1]} | {total[0] - total[1]} |")
    else:
        lines.append(f"{'all':<42} {total[0]:>6} {total[1]:>6} {total[0] - total[1]:>6}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", default=os.path.join(
                        os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "debug"),
                    help="where strata-plan and strata-exec are (built first unless --no-build)")
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer random inputs per class")
    ap.add_argument("--seed", type=int, default=23)
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    a = ap.parse_args()
    if not a.no_build:
        print("building strata-plan and strata-exec ...", file=sys.stderr)
        subprocess.run(["cargo", "build", "-p", "strata-plan", "-p", "strata-exec", "--bins"],
                       cwd=ROOT, check=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="strata-campaign-") as work:
        c = Campaign(a.bin_dir, work, a.quick, a.seed)
        for step in [c.endless_files, c.corrupt_files, c.broken_models, c.control_bytes,
                     c.api_keys, c.nan_weights, c.memory, c.templates, c.http_connections,
                     c.http_requests]:
            s0 = time.time()
            step()
            print(f"  {step.__name__}: {time.time() - s0:.0f} s", file=sys.stderr)
    print(table(c.rows, a.markdown))
    print(f"\n{time.time() - t0:.0f} s, seed {a.seed}{', quick' if a.quick else ''}")
    failed = [(cls, w) for cls, (_, _, ws) in c.rows.items() for w in ws]
    for cls, w in failed[:40]:
        print(f"FAILED [{cls}] {w}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
