#!/usr/bin/env python3
"""Build tiny random-weight Qwen3-MoE models with transformers and record float32 reference
outputs for the executor's CPU forward pass.

Needs python3 with torch, transformers and safetensors (the GPU machine has them; a CPU is
enough: the models are tiny and everything runs in float32 on the CPU for reproducibility).

For each variant it writes OUT/<variant>/ with:
  config.json        transformers' Qwen3MoeConfig
  model.safetensors  the weights under the Hugging Face hub checkpoint names
                     (model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight, one tensor
                     per expert, whatever layout the installed transformers uses inside)
  reference.json     {"prompts": [[ids]], "logits": [[[vocab floats] per position]],
                      "greedy": [[16 ids]], "hparams": {...}, "yarn": {...} | null,
                      "rope": {"inv_freq": [...], "attention_scaling": f}, "versions": {...}}
`hparams` uses the field names of strata_schemas::inventory::HParams, so a Rust test can
deserialize it directly.

Variants: "base" (norm_topk_prob true), "yarn" (rope_scaling yarn, factor 4,
original_max_position_embeddings 32) and "nonorm" (norm_topk_prob false). Total output
stays under 2 MB.

Usage: python3 scripts/make_reference.py --out tests/data/tiny-qwen3moe
"""

import argparse
import json
import math
import os
import sys

import torch

try:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    import transformers
except ImportError as e:  # pragma: no cover - message for people without transformers
    sys.exit(f"make_reference.py needs transformers with Qwen3-MoE support (>= 4.51): {e}")
try:
    from safetensors.torch import save_file
except ImportError as e:  # pragma: no cover
    sys.exit(f"make_reference.py needs the safetensors package: {e}")

N_GREEDY = 16
# Fixed prompts over a synthetic vocabulary (no tokenizer is involved).
PROMPTS = [
    [1, 2, 3, 4],
    [17, 200, 5, 5, 99, 128, 0, 255, 42],
    [7, 14, 21, 28, 35, 42, 49, 56, 63, 70, 77, 84, 91, 98, 105, 112, 119],
]

VARIANTS = {
    # name: (n_layer, norm_topk_prob, yarn (factor, original ctx) or None)
    "base": (2, True, None),
    "yarn": (1, True, (4.0, 32)),
    "nonorm": (1, False, None),
}


def make_config(n_layer, norm_topk_prob, yarn):
    kw = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,  # dense MLP width; unused (every layer is sparse)
        num_hidden_layers=n_layer,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        attention_bias=False,
        attention_dropout=0.0,
        use_sliding_window=False,
        decoder_sparse_step=1,
        moe_intermediate_size=32,
        num_experts_per_tok=2,
        num_experts=8,
        norm_topk_prob=norm_topk_prob,
        output_router_logits=False,
        mlp_only_layers=[],
        torch_dtype="float32",
    )
    if yarn is not None:
        factor, orig = yarn
        # Recent transformers derive the YaRN factor from max_position_embeddings /
        # original_max_position_embeddings when the latter is given; make both agree.
        kw["max_position_embeddings"] = int(factor * orig)
        kw["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": orig,
        }
    cfg = Qwen3MoeConfig(**kw)
    cfg._attn_implementation = "eager"  # plain float32 matmul + softmax attention
    return cfg


def init_weights(model, seed):
    """Deterministic weights that make every part matter: norms near 1, matrices with std
    1/sqrt(fan_in), embeddings std 1 (transformers' default init is too small to test)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            shape = tuple(p.shape)
            if "norm" in name:
                v = 1.0 + 0.1 * torch.randn(shape, generator=gen)
            elif "embed_tokens" in name:
                v = torch.randn(shape, generator=gen)
            else:
                v = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
            p.copy_(v.to(p.dtype))


def hub_state_dict(model, cfg):
    """The weights under the hub checkpoint names, splitting fused expert tensors
    (transformers >= 5 keeps experts as gate_up_proj [E, 2I, H] and down_proj [E, H, I])."""
    out = {}
    n_ff = cfg.moe_intermediate_size
    for name, t in model.state_dict().items():
        t = t.detach().to(torch.float32).contiguous()
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :n_ff, :].clone()
                out[f"{base}{e}.up_proj.weight"] = t[e, n_ff:, :].clone()
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t.clone()
    n_exp_tensors = sum(1 for k in out if ".mlp.experts." in k)
    want = cfg.num_hidden_layers * cfg.num_experts * 3
    if n_exp_tensors != want:
        sys.exit(f"expected {want} per-expert tensors, found {n_exp_tensors}: "
                 "this transformers version lays experts out in a way this script does not know")
    return out


def hparams(cfg, yarn):
    return {
        "n_layer": cfg.num_hidden_layers,
        "n_embd": cfg.hidden_size,
        "n_vocab": cfg.vocab_size,
        "n_ctx_train": yarn[1] if yarn else cfg.max_position_embeddings,
        "n_head": cfg.num_attention_heads,
        "n_head_kv": cfg.num_key_value_heads,
        "head_dim_k": cfg.head_dim,
        "head_dim_v": cfg.head_dim,
        "n_ff": 0,
        "n_expert": cfg.num_experts,
        "n_expert_used": cfg.num_experts_per_tok,
        "n_ff_exp": cfg.moe_intermediate_size,
        "rope_theta": 10000.0,
        "rms_eps": cfg.rms_norm_eps,
        "norm_topk_prob": cfg.norm_topk_prob,
        "tied_embeddings": False,
    }


def f32(v):
    # 9 significant digits round-trip a float32 exactly.
    return float("%.9g" % v)


def run_variant(out_dir, name, seed):
    n_layer, norm_topk, yarn = VARIANTS[name]
    torch.manual_seed(seed)
    cfg = make_config(n_layer, norm_topk, yarn)
    model = Qwen3MoeForCausalLM(cfg).to(torch.float32).eval()
    init_weights(model, seed)

    d = os.path.join(out_dir, name)
    os.makedirs(d, exist_ok=True)
    cfg.save_pretrained(d)
    save_file(hub_state_dict(model, cfg), os.path.join(d, "model.safetensors"),
              metadata={"format": "pt"})

    logits_all, greedy = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt], dtype=torch.long)
            out = model(input_ids=ids, use_cache=False).logits[0].to(torch.float32)
            logits_all.append([[f32(v) for v in row.tolist()] for row in out])
            seq = list(prompt)
            for _ in range(N_GREEDY):
                o = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
                seq.append(int(torch.argmax(o).item()))  # first max on ties
            greedy.append(seq[len(prompt):])

    rot = model.model.rotary_emb
    ref = {
        "variant": name,
        "prompts": PROMPTS,
        "logits": logits_all,
        "greedy": greedy,
        "hparams": hparams(cfg, yarn),
        "yarn": {"factor": yarn[0], "orig_ctx": yarn[1]} if yarn else None,
        "rope": {
            "inv_freq": [f32(v) for v in rot.inv_freq.to(torch.float32).tolist()],
            "attention_scaling": float(getattr(rot, "attention_scaling", 1.0)),
        },
        "seed": seed,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump(ref, f, separators=(",", ":"))
    if yarn:
        want = 0.1 * math.log(yarn[0]) + 1.0
        got = ref["rope"]["attention_scaling"]
        if abs(got - want) > 1e-6:
            sys.exit(f"{name}: transformers' YaRN attention scaling {got} != {want}: "
                     "check how this version reads rope_scaling")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output folder, e.g. tests/data/tiny-qwen3moe")
    ap.add_argument("--seed", type=int, default=20250601)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated subset of " + ",".join(VARIANTS))
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # same summation order on every run
    for i, name in enumerate(v for v in args.variants.split(",") if v):
        if name not in VARIANTS:
            sys.exit(f"--variants: unknown variant `{name}` (known: {', '.join(VARIANTS)})")
        run_variant(args.out, name, args.seed + i)
    total = 0
    for root, _, files in os.walk(args.out):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    print(f"wrote {args.out}: {total / 1e6:.2f} MB")
    if total > 2_000_000:
        print("warning: output is over 2 MB; keep test data small", file=sys.stderr)


if __name__ == "__main__":
    main()
