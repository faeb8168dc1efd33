#!/usr/bin/env python3
"""PyTorch/transformers baseline for `strata-exec bench`: a random-weight Qwen3-MoE at
Qwen3-30B-A3B's shapes (or smaller, by flags) in bf16 on one CUDA GPU; prints one JSON line
with prefill (pp) and decode (tg, batch 1, greedy, KV cache) tokens/s, mean and sd.

Usage: python3 scripts/bench_torch_moe.py [-p 512] [-n 128] [-r 3] [--layers 48]
"""
import argparse, json, statistics, time

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("-p", type=int, default=512)
ap.add_argument("-n", type=int, default=128)
ap.add_argument("-r", type=int, default=3)
ap.add_argument("--layers", type=int, default=48)
a = ap.parse_args()

cfg = Qwen3MoeConfig(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=a.layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
    rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
)
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)
t0 = time.time()
with torch.device("cuda"):
    model = Qwen3MoeForCausalLM(cfg)
model.eval()
build_s = time.time() - t0
gen = torch.Generator(device="cuda").manual_seed(1)


def one(seed):
    ids = torch.randint(0, cfg.vocab_size, (1, a.p), device="cuda", generator=gen)
    torch.cuda.synchronize()
    t = time.time()
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    torch.cuda.synchronize()
    pp = a.p / (time.time() - t)
    past = out.past_key_values
    nxt = out.logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    t = time.time()
    with torch.no_grad():
        for _ in range(a.n):
            out = model(input_ids=nxt, past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
            nxt.item()
    tg = a.n / (time.time() - t)
    return pp, tg


one(-1)  # warm-up
res = [one(i) for i in range(a.r)]
pps, tgs = [r[0] for r in res], [r[1] for r in res]
sd = lambda v: statistics.stdev(v) if len(v) > 1 else 0.0
print(json.dumps({
    "baseline": "transformers %s, torch %s, bf16, eager" % (__import__("transformers").__version__, torch.__version__),
    "gpu": torch.cuda.get_device_name(0), "layers": a.layers, "build_s": build_s,
    "prefill_tok_s": {"mean": statistics.mean(pps), "sd": sd(pps), "all": pps},
    "decode_tok_s": {"mean": statistics.mean(tgs), "sd": sd(tgs), "all": tgs},
}))
