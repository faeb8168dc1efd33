#!/usr/bin/env node
// The official `openai` Node client (and `ajv` to validate structured output) against a
// Strata server: a second real client besides tests/serve_openai.py. Models list, chat and
// completions streamed and not (the same greedy text), seeded sampling reproducible,
// `response_format` json_schema answers valid against their schema (ajv) and a rejected
// schema as the client's BadRequestError naming the field, a wrong key as
// AuthenticationError, then SIGINT and exit 0 when this script started the server.
//
// Modes (the packages come from NODE_PATH or a node_modules above this file; .ci/run
// installs them with `npm install --prefix DIR openai ajv`):
//   node tests/serve_openai_node.mjs            strata-serve-test (TinyEngine, tiny-chat tokenizer)
//   node tests/serve_openai_node.mjs --real     strata-exec PLAN --serve over tests/data/tiny-chat-moe
//   node tests/serve_openai_node.mjs --url http://H:P   a running server (--api-key test-key
//                                                       --model-name strata-tiny)
// Prints 'N passed, N failed' and exits non-zero on any failure.
import { spawn, execFileSync } from "node:child_process";
import { createRequire } from "node:module";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import readline from "node:readline";
import { fileURLToPath } from "node:url";

const require = createRequire(import.meta.url);
const OpenAI = require("openai").default ?? require("openai");
const Ajv = require("ajv").default ?? require("ajv");

const ROOT = path.dirname(path.dirname(fileURLToPath(import.meta.url)));
const KEY = "test-key";
const MODEL = "strata-tiny";
const args = process.argv.slice(2);

function targetBin(name) {
  const target = process.env.CARGO_TARGET_DIR || path.join(ROOT, "target");
  for (const profile of ["release", "debug"]) {
    const p = path.join(target, profile, name);
    if (fs.existsSync(p)) return p;
  }
  throw new Error(`${name} not found under ${target}: build it with cargo build -p strata-exec -p strata-plan --bins`);
}

function serverArgv() {
  const common = ["--port", "0", "--api-key", KEY, "--queue", "8"];
  if (args.includes("--real")) {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), "strata-node-"));
    const plan = path.join(dir, "tiny-chat.plan");
    execFileSync(targetBin("strata-plan"), [
      "--model", path.join(ROOT, "tests/data/tiny-chat-moe"),
      "--hardware", path.join(ROOT, "plans/hardware/cpu.toml"), "--gpu", "0",
      "--max-context", "256", "--batch", "2", "--ubatch", "8", "-o", plan,
    ], { stdio: ["ignore", "ignore", "inherit"] });
    return [targetBin("strata-exec"), plan, "--serve", "-q", "--model-name", MODEL, "--shutdown-grace", "2", ...common];
  }
  return [targetBin("strata-serve-test"), "--tokenizer", path.join(ROOT, "tests/data/tiny-chat"),
    "--slots", "2", "--ctx", "256", "--ubatch", "8", "--grace-ms", "2000", ...common];
}

async function startServer(argv) {
  console.log("starting:", argv.join(" "));
  const proc = spawn(argv[0], argv.slice(1), { stdio: ["ignore", "inherit", "pipe"] });
  const lines = readline.createInterface({ input: proc.stderr });
  const addr = await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error("the server did not print its address")), 300000);
    lines.on("line", (l) => {
      process.stderr.write(l + "\n");
      const m = l.match(/http:\/\/(\S+?):?\s*$/) || l.match(/http:\/\/([^\s:]+:\d+)/);
      if (m) { clearTimeout(timer); resolve(m[1]); }
    });
    proc.on("exit", (c) => reject(new Error(`the server exited with ${c} before printing its address`)));
  });
  await waitHealthy(addr);
  return { proc, addr };
}

async function waitHealthy(addr) {
  const deadline = Date.now() + 300000;
  while (Date.now() < deadline) {
    try {
      const r = await fetch(`http://${addr}/health`);
      if (r.status === 200) return;
    } catch { /* not up yet */ }
    await new Promise((r) => setTimeout(r, 50));
  }
  throw new Error("the server never became healthy");
}

function assert(cond, msg) {
  if (!cond) throw new Error(`assertion failed: ${msg}`);
}

const SCHEMA = {
  type: "object",
  properties: {
    name: { type: "string", maxLength: 6 },
    age: { type: "integer", minimum: 0, maximum: 150 },
    tags: { type: "array", items: { enum: ["red", "green", "blue"] }, maxItems: 3 },
    ok: { type: "boolean" },
  },
  required: ["name", "age", "tags", "ok"],
  additionalProperties: false,
};

const CHECKS = {
  async models_list(c) {
    const ids = [];
    for await (const m of c.models.list()) ids.push(m.id);
    assert(ids.includes(MODEL), `models: ${ids}`);
  },
  async chat_streamed_equals_whole(c) {
    const req = { model: MODEL, messages: [{ role: "user", content: "Hello there" }], max_tokens: 8, temperature: 0 };
    const whole = await c.chat.completions.create(req);
    const stream = await c.chat.completions.create({ ...req, stream: true, stream_options: { include_usage: true } });
    let text = "";
    let usage = null;
    for await (const ch of stream) {
      if (ch.choices.length) text += ch.choices[0].delta.content ?? "";
      if (ch.usage) usage = ch.usage;
    }
    assert(text === (whole.choices[0].message.content ?? ""), `stream ${JSON.stringify(text)} vs ${JSON.stringify(whole.choices[0].message.content)}`);
    assert(usage && usage.completion_tokens === whole.usage.completion_tokens, `usage ${JSON.stringify(usage)}`);
  },
  async completions_seeded_reproducible(c) {
    const req = { model: MODEL, prompt: "Once upon", max_tokens: 8, temperature: 0.9, seed: 11 };
    const a = await c.completions.create(req);
    const b = await c.completions.create(req);
    assert(a.choices[0].text === b.choices[0].text, "same seed, same text");
  },
  async structured_output_is_valid_against_its_schema(c) {
    const validate = new Ajv().compile(SCHEMA);
    for (let seed = 0; seed < 20; seed++) {
      const r = await c.chat.completions.create({
        model: MODEL, messages: [{ role: "user", content: "A person as JSON" }], max_tokens: 200,
        temperature: 1.0, seed,
        response_format: { type: "json_schema", json_schema: { name: "person", schema: SCHEMA, strict: true } },
      });
      const text = r.choices[0].message.content;
      const v = JSON.parse(text);
      assert(validate(v), `seed ${seed}: ${text}: ${JSON.stringify(validate.errors)}`);
      assert(r.choices[0].finish_reason === "stop", `seed ${seed}: ${r.choices[0].finish_reason}`);
    }
  },
  async rejected_schema_is_bad_request_naming_the_field(c) {
    try {
      await c.chat.completions.create({
        model: MODEL, messages: [{ role: "user", content: "x" }], max_tokens: 4,
        response_format: { type: "json_schema", json_schema: { name: "x", schema: { type: "frobnicate" } } },
      });
      throw new Error("a bad schema was accepted");
    } catch (e) {
      assert(e instanceof OpenAI.BadRequestError, `got ${e}`);
      assert(String(e.message).includes("response_format"), e.message);
    }
  },
  async wrong_key_is_authentication_error(c, addr) {
    const bad = new OpenAI({ baseURL: `http://${addr}/v1`, apiKey: "wrong", maxRetries: 0 });
    try {
      await bad.models.list();
      throw new Error("a wrong key was accepted");
    } catch (e) {
      assert(e instanceof OpenAI.AuthenticationError, `got ${e}`);
    }
  },
};

async function main() {
  let proc = null;
  let addr;
  const url = args.indexOf("--url");
  if (url >= 0) {
    addr = args[url + 1].split("://").pop().replace(/\/$/, "");
    await waitHealthy(addr);
  } else {
    ({ proc, addr } = await startServer(serverArgv()));
  }
  const client = new OpenAI({ baseURL: `http://${addr}/v1`, apiKey: KEY, maxRetries: 0, timeout: 120000 });
  let passed = 0;
  let failed = 0;
  for (const [name, fn] of Object.entries(CHECKS)) {
    try {
      await fn(client, addr);
      passed++;
      console.log(`ok   ${name}`);
    } catch (e) {
      failed++;
      console.log(`FAIL ${name}\n${e.stack ?? e}`);
    }
  }
  if (proc) {
    const code = await new Promise((resolve) => {
      const t = setTimeout(() => { proc.kill("SIGKILL"); resolve(null); }, 30000);
      proc.on("exit", (c) => { clearTimeout(t); resolve(c); });
      proc.kill("SIGINT");
    });
    if (code === 0) { passed++; console.log("ok   sigint_exits_zero"); }
    else { failed++; console.log(`FAIL sigint_exits_zero (exit code ${code})`); }
  }
  console.log(`${passed} passed, ${failed} failed`);
  process.exit(failed ? 1 : 0);
}

main().catch((e) => { console.error(e); process.exit(1); });
