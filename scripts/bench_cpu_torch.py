#!/usr/bin/env python3
"""PyTorch CPU baseline for scripts/bench_cpu.sh: prefill and decode tokens/s of a
random-weight transformers Qwen3MoeForCausalLM of the same shape as a strata model, in
float32 on the CPU with every core, for the same prompt length and generated tokens.

The shape comes from a GGUF's qwen3moe.* metadata (--gguf, read here without the gguf
package) or from flags with strata-gguf random's names (--layers --embd --heads ...).
Weights are transformers' own random init: speed does not depend on their values.
Timings: prefill = one forward over the prompt (use_cache); decode = N-1 single-token steps
with the KV cache, greedy; the first token comes from the prefill, as in strata-exec. One
warm-up run, then --reps runs; prints one JSON line with every run and the medians.

Needs torch and transformers (>= 4.51, Qwen3-MoE). Run both on the same machine:
    scripts/bench_cpu.sh target/release/strata-exec model.gguf 64 32 3
    python3 scripts/bench_cpu_torch.py --gguf model.gguf --prompt 64 --n 32 --reps 3
"""

import argparse
import json
import os
import statistics
import struct
import sys
import time


def gguf_metadata(path):
    """Key/value metadata of a GGUF file (v2/v3, little-endian; arrays are skipped), plus
    "@dims/NAME" for every tensor's dims."""
    scalars = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            sys.exit(f"{path}: not a GGUF file")
        (version,) = struct.unpack("<I", f.read(4))
        if version < 2:
            sys.exit(f"{path}: GGUF version {version} is too old")
        n_tensors, n_kv = struct.unpack("<QQ", f.read(16))

        def rstr():
            (n,) = struct.unpack("<Q", f.read(8))
            return f.read(n).decode("utf-8", "replace")

        def rval(t):
            if t in scalars:
                fmt = "<" + scalars[t]
                return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
            if t == 8:
                return rstr()
            if t == 9:
                et, n = struct.unpack("<IQ", f.read(12))
                if et in scalars:
                    f.seek(n * struct.calcsize(scalars[et]), 1)
                else:
                    for _ in range(n):
                        rval(et)
                return None
            sys.exit(f"{path}: unknown GGUF value type {t}")

        meta = {}
        for _ in range(n_kv):
            k = rstr()
            (t,) = struct.unpack("<I", f.read(4))
            meta[k] = rval(t)
        for _ in range(n_tensors):
            name = rstr()
            (nd,) = struct.unpack("<I", f.read(4))
            meta["@dims/" + name] = struct.unpack(f"<{nd}Q", f.read(8 * nd))
            f.seek(12, 1)  # type u32, offset u64
        return meta


def shape_from_gguf(path):
    m = gguf_metadata(path)
    arch = m.get("general.architecture")
    if arch != "qwen3moe":
        sys.exit(f"{path}: architecture {arch!r}; this baseline builds qwen3moe only")
    g = lambda k, d=None: m.get(f"qwen3moe.{k}", d)
    emb = m.get("@dims/token_embd.weight")
    return dict(
        vocab=emb[1] if emb else None,
        layers=g("block_count"),
        embd=g("embedding_length"),
        heads=g("attention.head_count"),
        kv_heads=g("attention.head_count_kv"),
        head_dim=g("attention.key_length"),
        experts=g("expert_count"),
        experts_used=g("expert_used_count"),
        ff_exp=g("expert_feed_forward_length"),
        rope_theta=g("rope.freq_base", 1e6),
        rms_eps=g("attention.layer_norm_rms_epsilon", 1e-6),
        norm_topk=g("expert_weights_norm", True),
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", help="take the shape from this GGUF's metadata")
    for k in ["layers", "embd", "heads", "kv-heads", "head-dim", "experts", "experts-used", "ff-exp", "vocab"]:
        ap.add_argument(f"--{k}", type=int)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (default 64)")
    ap.add_argument("--n", type=int, default=32, help="generated tokens (default 32)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()

    shape = dict(rope_theta=1e6, rms_eps=1e-6, norm_topk=True)
    if a.gguf:
        shape.update(shape_from_gguf(a.gguf))
    for k in ["layers", "embd", "heads", "kv_heads", "head_dim", "experts", "experts_used", "ff_exp", "vocab"]:
        v = getattr(a, k)
        if v is not None:
            shape[k] = v
    if shape.get("vocab") is None:
        shape["vocab"] = 151936
        print("bench_cpu_torch.py: --vocab not given; using Qwen3's 151936", file=sys.stderr)
    missing = [k for k in ["layers", "embd", "heads", "kv_heads", "head_dim", "experts", "experts_used", "ff_exp"] if shape.get(k) is None]
    if missing:
        sys.exit(f"bench_cpu_torch.py: give --gguf or the shape flags; missing: {', '.join(missing)}")

    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    import transformers

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["embd"],
        intermediate_size=2 * shape["ff_exp"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        moe_intermediate_size=shape["ff_exp"],
        num_experts=shape["experts"],
        num_experts_per_tok=shape["experts_used"],
        norm_topk_prob=bool(shape["norm_topk"]),
        rms_norm_eps=float(shape["rms_eps"]),
        rope_theta=float(shape["rope_theta"]),
        max_position_embeddings=max(4096, a.prompt + a.n + 8),
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = Qwen3MoeForCausalLM(cfg).to(torch.float32).eval()
    # The prompt bench_cpu.sh gives strata-exec: 7, 14, 21, ... mod 200.
    ids = torch.tensor([[(7 * (i + 1)) % 200 for i in range(a.prompt)]], dtype=torch.long)

    def once():
        with torch.no_grad():
            t0 = time.perf_counter()
            out = model(input_ids=ids, use_cache=True)
            t1 = time.perf_counter()
            past = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
            t2 = time.perf_counter()
            for _ in range(a.n - 1):
                out = model(input_ids=nxt, past_key_values=past, use_cache=True)
                past = out.past_key_values
                nxt = out.logits[:, -1:].argmax(-1)
            t3 = time.perf_counter()
        return a.prompt / (t1 - t0), (a.n - 1) / max(t3 - t2, 1e-9)

    once()  # warm-up
    runs = [once() for _ in range(a.reps)]
    pre = [round(r[0], 2) for r in runs]
    dec = [round(r[1], 2) for r in runs]
    print(json.dumps({
        "tool": "transformers",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "threads": torch.get_num_threads(),
        "shape": shape,
        "prompt": a.prompt,
        "n": a.n,
        "prefill_tok_s": pre,
        "decode_tok_s": dec,
        "prefill_median": statistics.median(pre),
        "decode_median": statistics.median(dec),
    }))


if __name__ == "__main__":
    main()
