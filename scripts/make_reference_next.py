#!/usr/bin/env python3
"""Build tiny random-weight Qwen3-Next models with transformers and record float32 reference
outputs for the executor's Qwen3-Next forward pass (CPU and CUDA) and for `strata-gguf convert`.

Needs python3 with torch, transformers (with Qwen3-Next, >= 4.57; written against 5.17) and
safetensors. The GPU machine has them; the work runs on its CPU (float32, eager attention,
one thread, fixed seed) in a few seconds.

Usage:
    python3 scripts/make_reference_next.py --out tests/data/tiny-qwen3next
    # options: --seed N (default 20250817), --variants base,interval2,odd,cuda

For each variant it writes OUT/<variant>/ with:
  config.json        transformers' Qwen3NextConfig, plus `full_attention_interval` (the hub
                     configs carry it and llama.cpp's converter reads it; transformers 5 keeps
                     only `layer_types`)
  model.safetensors  float32 weights under the Hugging Face hub checkpoint names: one tensor per
                     routed expert (model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight)
                     whatever layout the installed transformers uses inside, and, for variants
                     with an MTP block, random `mtp.*` tensors in the hub layout (transformers'
                     Qwen3NextForCausalLM has no MTP module: it ignores `mtp.*` on load, so no
                     MTP reference logits are recorded)
  reference.json     {"prompts": [[ids]], "logits": [[[vocab floats] per position]],
                      "logits_kv_f16": the same with K and V rounded to float16 as they
                      enter the cache (what an engine with an f16 KV cache computes),
                      "greedy": [[16 ids]], "greedy_cached": [[16 ids]],
                      "hidden_states": {"prompt": 1, "layers": [[[n_embd] per position]]},
                      "hparams": {...}, "layer_types": [...], "rope": {...},
                      "seed": n, "versions": {...}}
`hparams` uses the field names of strata_schemas::inventory::HParams (with `ssm`), so a Rust
test can deserialize it directly. `greedy` recomputes the whole sequence each step (transformers
then runs the chunked delta rule); `greedy_cached` decodes with the cache (the recurrent step and
the rolling conv state); the script warns when they differ. `hidden_states.layers` is the
residual stream for prompt 1, captured with forward hooks: the embeddings, each decoder layer's
output, then the final norm's output (n_layer + 2 entries), to find the first layer that goes
wrong.

Every value is checked before anything is written: the saved folder is loaded back with
`from_pretrained` and must give bit-identical logits (so the hub names are right), the MTP
tensors must have the shapes of a full-attention block, and the total size is reported.

The formulas transformers uses (and the executor must match) are written down in
docs/QWEN3NEXT.md, next to llama.cpp's storage of the same tensors.
"""

import argparse
import json
import math
import os
import sys

try:
    import torch
except ImportError as e:  # pragma: no cover
    sys.exit(f"make_reference_next.py needs torch: {e}")
try:
    import transformers
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    from transformers.models.qwen3_next import modeling_qwen3_next as qn
except ImportError as e:  # pragma: no cover
    sys.exit(f"make_reference_next.py needs transformers with Qwen3-Next (>= 4.57): {e}")
try:
    from safetensors.torch import save_file
except ImportError as e:  # pragma: no cover
    sys.exit(f"make_reference_next.py needs the safetensors package: {e}")

N_GREEDY = 16
VOCAB = 128
# Fixed prompts over a synthetic vocabulary (no tokenizer is involved).
PROMPTS = [
    [1, 2, 3, 4],
    [17, 100, 5, 5, 99, 127, 0, 64, 42],
    [7, 14, 21, 28, 35, 42, 49, 56, 63, 70, 77, 84, 91, 98, 105, 112, 119],
]
# 70 tokens: more than one 64-token chunk of the chunked delta rule.
LONG_PROMPT = [(i * 37 + 11) % VOCAB for i in range(70)]

# Each variant: the shape, what it covers, whether it has an MTP block and the long prompt.
VARIANTS = {
    # 3 linear + 1 full attention, linear key heads < value heads (ratio 2), MTP block.
    "base": dict(
        layers=4, interval=4, hidden=64, heads=4, kv_heads=2, head_dim=16,
        nk=2, nv=4, dk=16, conv=4, experts=4, top_k=2, ff_exp=16, ff_shexp=24,
        mtp=True, long=True,
    ),
    # 1 linear + 1 full attention (full_attention_interval 2), equal key and value heads.
    "interval2": dict(
        layers=2, interval=2, hidden=64, heads=4, kv_heads=2, head_dim=16,
        nk=4, nv=4, dk=8, conv=4, experts=4, top_k=2, ff_exp=16, ff_shexp=24,
        mtp=False, long=False,
    ),
    # Odd sizes: hidden 48, 3 query heads over 1 KV head of 24 (6 rotated dims), 3 key heads
    # and 6 value heads of 12, conv width 3, 5 experts top-3, shared expert width 12.
    "odd": dict(
        layers=3, interval=3, hidden=48, heads=3, kv_heads=1, head_dim=24,
        nk=3, nv=6, dk=12, conv=3, experts=5, top_k=3, ff_exp=20, ff_shexp=12,
        mtp=False, long=False,
    ),
    # The shapes the CUDA kernels take (hidden and expert widths multiples of 32): 2 linear +
    # 2 full attention, 8 experts top-2 of width 32, an MTP block, the long prompt.
    "cuda": dict(
        layers=4, interval=2, hidden=64, heads=4, kv_heads=2, head_dim=16,
        nk=2, nv=4, dk=16, conv=4, experts=8, top_k=2, ff_exp=32, ff_shexp=32,
        mtp=True, long=True,
    ),
}

PARTIAL_ROTARY = 0.25
ROPE_THETA = 10000.0
RMS_EPS = 1e-6


def fail(msg):
    sys.exit(f"make_reference_next.py: {msg}")


def make_config(v):
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=v["hidden"],
        intermediate_size=4 * v["hidden"],  # dense MLP width; unused (every layer is sparse)
        num_hidden_layers=v["layers"],
        num_attention_heads=v["heads"],
        num_key_value_heads=v["kv_heads"],
        head_dim=v["head_dim"],
        hidden_act="silu",
        max_position_embeddings=256,
        rms_norm_eps=RMS_EPS,
        tie_word_embeddings=False,
        rope_theta=ROPE_THETA,
        partial_rotary_factor=PARTIAL_ROTARY,
        attention_bias=False,
        attention_dropout=0.0,
        linear_conv_kernel_dim=v["conv"],
        linear_key_head_dim=v["dk"],
        linear_value_head_dim=v["dk"],  # llama.cpp's qwen3next needs value head dim = key head dim
        linear_num_key_heads=v["nk"],
        linear_num_value_heads=v["nv"],
        decoder_sparse_step=1,
        moe_intermediate_size=v["ff_exp"],
        shared_expert_intermediate_size=v["ff_shexp"],
        num_experts_per_tok=v["top_k"],
        num_experts=v["experts"],
        norm_topk_prob=True,  # llama.cpp's qwen3next always renormalizes the top-k weights
        output_router_logits=False,
        mlp_only_layers=[],
        full_attention_interval=v["interval"],
    )
    cfg = Qwen3NextConfig(**kw)
    cfg._attn_implementation = "eager"  # plain float32 matmul + softmax attention
    want = ["full_attention" if (i + 1) % v["interval"] == 0 else "linear_attention"
            for i in range(v["layers"])]
    if list(cfg.layer_types) != want:
        fail(f"config layer_types {cfg.layer_types} != {want}: this transformers version reads "
             "full_attention_interval differently; set layer_types explicitly")
    return cfg


def init_params(named, gen):
    """Deterministic weights that make every part matter (transformers' init is too small to
    test): zero-centred norms small around 0 (the model multiplies by 1 + w), the gated norm
    near 1, matrices std 1/sqrt(fan_in), embeddings std 1, decays that keep a memory over a
    few tokens (A in [0.05, 1), dt_bias ~ N(0, 0.5))."""
    with torch.no_grad():
        for name, p in named:
            shape = tuple(p.shape)
            if name.endswith("linear_attn.norm.weight"):
                v = 1.0 + 0.1 * torch.randn(shape, generator=gen)
            elif "norm" in name:
                v = 0.1 * torch.randn(shape, generator=gen)
            elif name.endswith("A_log"):
                v = torch.log(0.05 + 0.95 * torch.rand(shape, generator=gen))
            elif name.endswith("dt_bias"):
                v = 0.5 * torch.randn(shape, generator=gen)
            elif "embed_tokens" in name:
                v = torch.randn(shape, generator=gen)
            else:
                v = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
            p.copy_(v.to(p.dtype))


def hub_names(sd, n_expert, n_ff, prefix_from=None, prefix_to=None):
    """A state dict under the hub checkpoint names: fused expert tensors (transformers >= 5
    keeps gate_up_proj [E, 2I, H] and down_proj [E, H, I]) split into one tensor per expert;
    optionally re-prefixed (for the MTP block)."""
    out = {}
    for name, t in sd.items():
        t = t.detach().to(torch.float32).contiguous()
        if prefix_from is not None:
            if not name.startswith(prefix_from):
                fail(f"unexpected tensor {name} (wanted prefix {prefix_from})")
            name = prefix_to + name[len(prefix_from):]
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            if tuple(t.shape)[:2] != (n_expert, 2 * n_ff):
                fail(f"{name} has shape {tuple(t.shape)}; expected [E, 2I, H]")
            for e in range(n_expert):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :n_ff, :].clone()
                out[f"{base}{e}.up_proj.weight"] = t[e, n_ff:, :].clone()
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(n_expert):
                out[f"{base}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t.clone()
    return out


def expected_hub_shapes(v, layer_types):
    """Every hub tensor name and shape of the main model, from the variant alone: a
    transformers version that names or shapes anything differently fails here, loudly."""
    h, hd, nh, nkv = v["hidden"], v["head_dim"], v["heads"], v["kv_heads"]
    key_dim, value_dim = v["nk"] * v["dk"], v["nv"] * v["dk"]
    s = {"model.embed_tokens.weight": [VOCAB, h], "model.norm.weight": [h],
         "lm_head.weight": [VOCAB, h]}
    for i, kind in enumerate(layer_types):
        p = f"model.layers.{i}"
        s[f"{p}.input_layernorm.weight"] = [h]
        s[f"{p}.post_attention_layernorm.weight"] = [h]
        if kind == "linear_attention":
            s[f"{p}.linear_attn.in_proj_qkvz.weight"] = [2 * key_dim + 2 * value_dim, h]
            s[f"{p}.linear_attn.in_proj_ba.weight"] = [2 * v["nv"], h]
            s[f"{p}.linear_attn.conv1d.weight"] = [2 * key_dim + value_dim, 1, v["conv"]]
            s[f"{p}.linear_attn.dt_bias"] = [v["nv"]]
            s[f"{p}.linear_attn.A_log"] = [v["nv"]]
            s[f"{p}.linear_attn.norm.weight"] = [v["dk"]]
            s[f"{p}.linear_attn.out_proj.weight"] = [h, value_dim]
        else:
            s[f"{p}.self_attn.q_proj.weight"] = [2 * nh * hd, h]
            s[f"{p}.self_attn.k_proj.weight"] = [nkv * hd, h]
            s[f"{p}.self_attn.v_proj.weight"] = [nkv * hd, h]
            s[f"{p}.self_attn.o_proj.weight"] = [h, nh * hd]
            s[f"{p}.self_attn.q_norm.weight"] = [hd]
            s[f"{p}.self_attn.k_norm.weight"] = [hd]
        s[f"{p}.mlp.gate.weight"] = [v["experts"], h]
        for e in range(v["experts"]):
            s[f"{p}.mlp.experts.{e}.gate_proj.weight"] = [v["ff_exp"], h]
            s[f"{p}.mlp.experts.{e}.up_proj.weight"] = [v["ff_exp"], h]
            s[f"{p}.mlp.experts.{e}.down_proj.weight"] = [h, v["ff_exp"]]
        s[f"{p}.mlp.shared_expert.gate_proj.weight"] = [v["ff_shexp"], h]
        s[f"{p}.mlp.shared_expert.up_proj.weight"] = [v["ff_shexp"], h]
        s[f"{p}.mlp.shared_expert.down_proj.weight"] = [h, v["ff_shexp"]]
        s[f"{p}.mlp.shared_expert_gate.weight"] = [1, h]
    return s


def check_shapes(got, want, what):
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    if missing or extra:
        fail(f"{what}: tensor names differ from the hub layout; missing {missing[:8]}, "
             f"unexpected {extra[:8]}")
    for k, shape in want.items():
        if list(got[k].shape) != shape:
            fail(f"{what}: {k} has shape {list(got[k].shape)}, the hub layout has {shape}")


def mtp_tensors(cfg, v, gen):
    """Random MTP weights in the hub layout (`mtp.fc`, `mtp.pre_fc_norm_embedding`,
    `mtp.pre_fc_norm_hidden`, `mtp.norm`, and `mtp.layers.0.*`: one full-attention MoE block
    named like the main blocks). The block is built from transformers' own decoder layer for
    a full-attention index, so its names and shapes are the main blocks'."""
    full_idx = v["interval"] - 1
    layer = qn.Qwen3NextDecoderLayer(cfg, full_idx).to(torch.float32)
    init_params(sorted(layer.named_parameters(), key=lambda kv: kv[0]), gen)
    out = hub_names({f"L.{k}": t for k, t in layer.state_dict().items()}, v["experts"],
                    v["ff_exp"], prefix_from="L.", prefix_to="mtp.layers.0.")
    h = v["hidden"]
    with torch.no_grad():
        out["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=gen) / math.sqrt(2 * h)
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            out[f"mtp.{n}.weight"] = 0.1 * torch.randn(h, generator=gen)
    main = expected_hub_shapes(v, ["full_attention"])
    want = {k.replace("model.layers.0.", "mtp.layers.0."): s for k, s in main.items()
            if k.startswith("model.layers.0.")}
    want.update({"mtp.fc.weight": [h, 2 * h], "mtp.pre_fc_norm_embedding.weight": [h],
                 "mtp.pre_fc_norm_hidden.weight": [h], "mtp.norm.weight": [h]})
    check_shapes(out, want, "MTP block")
    return out


def hparams(cfg, v):
    return {
        "n_layer": v["layers"],
        "n_embd": v["hidden"],
        "n_vocab": VOCAB,
        "n_ctx_train": cfg.max_position_embeddings,
        "n_head": v["heads"],
        "n_head_kv": v["kv_heads"],
        "head_dim_k": v["head_dim"],
        "head_dim_v": v["head_dim"],
        "n_ff": 0,
        "n_expert": v["experts"],
        "n_expert_used": v["top_k"],
        "n_ff_exp": v["ff_exp"],
        "n_ff_shexp": v["ff_shexp"],
        "full_attention_interval": v["interval"],
        "ssm": {
            "conv_kernel": v["conv"],
            "state_size": v["dk"],
            "group_count": v["nk"],
            "time_step_rank": v["nv"],
            "inner_size": v["nv"] * v["dk"],
        },
        "nextn_predict_layers": 1 if v["mtp"] else 0,
        "rope_theta": ROPE_THETA,
        "rope_dim": int(v["head_dim"] * PARTIAL_ROTARY),
        "rms_eps": RMS_EPS,
        "norm_topk_prob": True,
        "tied_embeddings": False,
    }


def f32(x):
    # 9 significant digits round-trip a float32 exactly.
    return float("%.9g" % x)


def rows(t):
    return [[f32(x) for x in r.tolist()] for r in t]


def greedy_full(model, prompt):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(N_GREEDY):
            o = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
            seq.append(int(torch.argmax(o).item()))  # first max on ties
    return seq[len(prompt):]


def greedy_cached(model, prompt):
    out = []
    with torch.no_grad():
        r = model(input_ids=torch.tensor([prompt]), use_cache=True)
        past = r.past_key_values
        nxt = int(torch.argmax(r.logits[0, -1]).item())
        for _ in range(N_GREEDY):
            out.append(nxt)
            r = model(input_ids=torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
            past = r.past_key_values
            nxt = int(torch.argmax(r.logits[0, -1]).item())
    return out


def capture_hidden(model, prompt):
    """The residual stream for one prompt, from forward hooks (independent of how a
    transformers version assembles output_hidden_states): the embeddings, each decoder
    layer's output, and the final norm's output."""
    seen = []

    def keep(_m, _i, out):
        t = out[0] if isinstance(out, (tuple, list)) else out
        seen.append(rows(t[0].detach().to(torch.float32)))

    mods = [model.model.embed_tokens, *model.model.layers, model.model.norm]
    hooks = [m.register_forward_hook(keep) for m in mods]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([prompt]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    if len(seen) != len(mods):
        fail(f"captured {len(seen)} hidden states, expected {len(mods)}")
    return seen


def logits_with_f16_kv(model, prompts):
    """Every prompt's logits with the full-attention layers' K (after QK-norm and RoPE) and V
    rounded to float16 as they enter the cache, as the engines store a plan's f16 KV: the
    reference an engine's f32 arithmetic over an f16 cache matches to float noise (the plain
    float32 logits differ from it by that rounding alone, up to ~4e-4 of the largest logit
    on these models)."""
    mod = sys.modules[type(model).__module__]
    rope = getattr(mod, "apply_rotary_pos_emb", None)
    if rope is None:
        fail(f"{mod.__name__} has no apply_rotary_pos_emb to round K at: this transformers "
             "version builds attention differently")

    def rope_then_round(q, k, *a, **kw):
        q, k = rope(q, k, *a, **kw)
        return q, k.to(torch.float16).to(torch.float32)

    hooks = [m.self_attn.v_proj.register_forward_hook(
                 lambda _m, _i, out: out.to(torch.float16).to(torch.float32))
             for m in model.model.layers if hasattr(m, "self_attn")]
    if not hooks:
        fail("no full-attention layer found to round V in")
    mod.apply_rotary_pos_emb = rope_then_round
    try:
        with torch.no_grad():
            return [rows(model(input_ids=torch.tensor([p]), use_cache=False).logits[0]
                         .to(torch.float32)) for p in prompts]
    finally:
        mod.apply_rotary_pos_emb = rope
        for h in hooks:
            h.remove()


def load_back(d):
    try:
        m = Qwen3NextForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                 attn_implementation="eager")
    except TypeError:  # transformers 4.x spells it torch_dtype
        m = Qwen3NextForCausalLM.from_pretrained(d, torch_dtype=torch.float32,
                                                 attn_implementation="eager")
    return m.eval()


def run_variant(out_dir, name, seed):
    v = VARIANTS[name]
    print(f"[{name}] building: {v['layers']} layers, interval {v['interval']}, "
          f"hidden {v['hidden']}, linear heads {v['nk']}k/{v['nv']}v x {v['dk']}", flush=True)
    torch.manual_seed(seed)
    cfg = make_config(v)
    model = Qwen3NextForCausalLM(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    init_params(sorted(model.named_parameters(), key=lambda kv: kv[0]), gen)

    rot = model.model.rotary_emb
    n_rot = int(v["head_dim"] * PARTIAL_ROTARY)
    if rot.inv_freq.numel() * 2 != n_rot:
        fail(f"[{name}] rotary embedding has {rot.inv_freq.numel()} frequencies; expected "
             f"{n_rot // 2} (partial_rotary_factor {PARTIAL_ROTARY} of head_dim "
             f"{v['head_dim']}): this transformers version reads partial_rotary_factor "
             "differently")

    weights = hub_names(model.state_dict(), v["experts"], v["ff_exp"])
    check_shapes(weights, expected_hub_shapes(v, cfg.layer_types), f"[{name}] main model")
    if v["mtp"]:
        weights.update(mtp_tensors(cfg, v, gen))

    d = os.path.join(out_dir, name)
    os.makedirs(d, exist_ok=True)
    cfg.save_pretrained(d)
    cfg_path = os.path.join(d, "config.json")
    with open(cfg_path) as f:
        cj = json.load(f)
    cj["full_attention_interval"] = v["interval"]
    with open(cfg_path, "w") as f:
        json.dump(cj, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file(weights, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    print(f"[{name}] wrote {len(weights)} tensors", flush=True)

    prompts = PROMPTS + ([LONG_PROMPT] if v["long"] else [])
    logits_all, greedy, cached = [], [], []
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            out = model(input_ids=torch.tensor([prompt]), use_cache=False).logits[0]
            logits_all.append(rows(out.to(torch.float32)))
            greedy.append(greedy_full(model, prompt))
            cached.append(greedy_cached(model, prompt))
            if cached[-1] != greedy[-1]:
                print(f"[{name}] warning: prompt {i}: cached greedy {cached[-1]} differs from "
                      f"the recomputed one {greedy[-1]} (float noise near a tie?)",
                      file=sys.stderr)
            print(f"[{name}] prompt {i} ({len(prompt)} tokens): greedy {greedy[-1]}", flush=True)
        hidden = capture_hidden(model, PROMPTS[1])
    logits_f16kv = logits_with_f16_kv(model, prompts)

    # The folder must load back into transformers and give the same logits bit for bit.
    back = load_back(d)
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            a = model(input_ids=torch.tensor([prompt]), use_cache=False).logits
            b = back(input_ids=torch.tensor([prompt]), use_cache=False).logits
            if not torch.equal(a, b):
                fail(f"[{name}] the saved folder loads back with different logits (prompt {i}, "
                     f"max diff {(a - b).abs().max().item():.3g}): the hub names in "
                     "model.safetensors do not match what this transformers version loads")
    print(f"[{name}] reloaded from {d}: logits identical", flush=True)

    ref = {
        "variant": name,
        "prompts": prompts,
        "logits": logits_all,
        "logits_kv_f16": logits_f16kv,
        "greedy": greedy,
        "greedy_cached": cached,
        "hidden_states": {"prompt": 1, "layers": hidden},
        "hparams": hparams(cfg, v),
        "layer_types": list(cfg.layer_types),
        "rope": {
            "inv_freq": [f32(x) for x in rot.inv_freq.to(torch.float32).tolist()],
            "attention_scaling": float(getattr(rot, "attention_scaling", 1.0)),
        },
        "seed": seed,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump(ref, f, separators=(",", ":"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output folder, e.g. tests/data/tiny-qwen3next")
    ap.add_argument("--seed", type=int, default=20250817)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated subset of " + ",".join(VARIANTS))
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # same summation order on every run
    names = [n for n in args.variants.split(",") if n]
    for n in names:
        if n not in VARIANTS:
            fail(f"--variants: unknown variant `{n}` (known: {', '.join(VARIANTS)})")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
    # Each variant's seed is its place in VARIANTS, so a subset (--variants cuda) rebuilds
    # exactly what the full run writes for it.
    for n in names:
        run_variant(args.out, n, args.seed + list(VARIANTS).index(n))
    total = 0
    for root, _, files in os.walk(args.out):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    print(f"wrote {args.out}: {total / 1e6:.2f} MB")
    if total > 2_500_000:
        print("warning: output is over 5 MB; keep test data small", file=sys.stderr)


if __name__ == "__main__":
    main()
