#!/usr/bin/env python3
"""Writes the tiny random Qwen3-MoE folder the server tests run with the real CPU engine.

Why it exists: the reference model in ../tiny-qwen3moe has a 256-token vocabulary, smaller
than the tiny-chat tokenizer (400 tokens, with a ChatML chat template), so chat requests
through `strata-exec PLAN --serve` need a model whose vocabulary covers that tokenizer.
Invariant: deterministic (a fixed 64-bit LCG, no numpy); F32 weights scaled like the Rust
test helper `random_folder` (executor/tests/common), so activations stay finite; the folder
also holds copies of ../tiny-chat/tokenizer.json and tokenizer_config.json, so
`Tokenizer::for_model` finds them. Run from anywhere: `python3 make_model.py`.
"""
import json
import os
import shutil
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB, HIDDEN, LAYERS, EXPERTS, USED, FF = 400, 64, 2, 4, 2, 32
HEADS, KV_HEADS = 4, 2
HD = HIDDEN // HEADS
SEED = 6


def main():
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": HIDDEN, "intermediate_size": 2 * FF, "moe_intermediate_size": FF,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HD, "num_experts": EXPERTS,
        "num_experts_per_tok": USED, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 4096, "vocab_size": VOCAB,
        "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "torch_dtype": "float32", "bos_token_id": None, "eos_token_id": 399,
    }
    with open(os.path.join(HERE, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    w = 1.0 / HIDDEN ** 0.5
    specs = [("model.embed_tokens.weight", [VOCAB, HIDDEN], 1.0, 0.0),
             ("lm_head.weight", [VOCAB, HIDDEN], 0.2, 0.0),
             ("model.norm.weight", [HIDDEN], 0.2, 1.0)]
    for l in range(LAYERS):
        p = f"model.layers.{l}"
        for s, shape, sc, off in [
            ("input_layernorm", [HIDDEN], 0.2, 1.0),
            ("post_attention_layernorm", [HIDDEN], 0.2, 1.0),
            ("self_attn.q_norm", [HD], 0.2, 1.0),
            ("self_attn.k_norm", [HD], 0.2, 1.0),
            ("self_attn.q_proj", [HEADS * HD, HIDDEN], w, 0.0),
            ("self_attn.k_proj", [KV_HEADS * HD, HIDDEN], w, 0.0),
            ("self_attn.v_proj", [KV_HEADS * HD, HIDDEN], w, 0.0),
            ("self_attn.o_proj", [HIDDEN, HEADS * HD], w, 0.0),
            ("mlp.gate", [EXPERTS, HIDDEN], w, 0.0),
        ]:
            specs.append((f"{p}.{s}.weight", shape, sc, off))
        for e in range(EXPERTS):
            m = f"{p}.mlp.experts.{e}"
            specs.append((f"{m}.gate_proj.weight", [FF, HIDDEN], w, 0.0))
            specs.append((f"{m}.up_proj.weight", [FF, HIDDEN], w, 0.0))
            specs.append((f"{m}.down_proj.weight", [HIDDEN, FF], 1.0 / FF ** 0.5, 0.0))
    state = SEED ^ 0x9E3779B97F4A7C15
    mask = (1 << 64) - 1
    header, data = {}, bytearray()
    for name, shape, sc, off in specs:
        n = 1
        for d in shape:
            n *= d
        start = len(data)
        vals = []
        for _ in range(n):
            state = (state * 6364136223846793005 + 1442695040888963407) & mask
            vals.append(off + sc * (((state >> 40) / float(1 << 24)) * 2.0 - 1.0))
        data += struct.pack(f"<{n}f", *vals)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [start, len(data)]}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(os.path.join(HERE, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        f.write(data)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(HERE, "..", "tiny-chat", name), os.path.join(HERE, name))


if __name__ == "__main__":
    main()
