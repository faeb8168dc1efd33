//! The feasibility report: human text and the JSON contract of DESIGN.md, built from a plan
//! (so `inspect` prints the same report back) or from an infeasible outcome.
//! Invariant: the JSON keys named in DESIGN.md are always present; text and JSON come from
//! the same numbers; the header says FEASIBLE only over a plan with no degradation, and
//! whether this build runs the plan comes from `capability::runnable`, the table the executor
//! refuses by.

use crate::solve::Infeasible;
use crate::units::bytes as gib;
use serde_json::{json, Map, Value};
use strata_schemas::capability::{runnable, Runnable};
use strata_schemas::plan::{
    DecodePoint, DeviceCost, DevicePlan, KvHostPolicy, MissPolicy, Placement, Plan, RegionKind,
    PINNED_EXPERTS,
};

/// `{"cpu": true, "cuda": ["reason", ...], "hip": [...]}`.
pub fn runnable_json(r: &Runnable) -> Value {
    let mut m = Map::new();
    for (b, v) in &r.0 {
        m.insert(
            b.as_str().into(),
            match v {
                Ok(()) => json!(true),
                Err(why) => json!(why),
            },
        );
    }
    Value::Object(m)
}

/// The runnable section of a text report (one line per backend, a line per reason).
pub fn runnable_text(r: &Runnable) -> String {
    let mut o = String::new();
    for (b, v) in &r.0 {
        match v {
            Ok(()) => o.push_str(&format!("    {:<5} yes\n", b.as_str())),
            Err(why) => {
                o.push_str(&format!("    {:<5} no: {}\n", b.as_str(), why[0]));
                for w in &why[1..] {
                    o.push_str(&format!("          {w}\n"));
                }
            }
        }
    }
    o
}

/// Notes on the inputs' quality: measured or assumed free memory, guessed coefficients.
pub fn notes(plan: &Plan) -> Vec<String> {
    let mut out = Vec::new();
    let assumed: Vec<String> = plan
        .devices
        .iter()
        .filter(|d| !d.free_bytes_probed && d.vendor != "cpu")
        .map(|d| d.index.to_string())
        .collect();
    if !assumed.is_empty() {
        out.push(format!(
            "device(s) {}: free memory is assumed (vram_bytes minus the runtime reserve) because the probe has no free_bytes; run `strata-exec probe -o probe.toml` on the machine for measured figures",
            assumed.join(", ")
        ));
    }
    let n_expert = plan.model.n_expert;
    for d in &plan.devices {
        let cached_layers = plan
            .tensors
            .iter()
            .filter(|t| {
                t.name.ends_with("ffn_gate_exps.weight")
                    && matches!(t.placement, Placement::HostExperts { device } if device == d.index)
            })
            .count() as u64;
        let tier = plan
            .host
            .pinned_chunks
            .iter()
            .any(|c| c.device == d.index && c.purpose == PINNED_EXPERTS);
        if d.vendor == "nvidia"
            && (d.resident_experts.len() as u64) < cached_layers * n_expert
            && !tier
        {
            out.push(format!(
                "device {}: its host expert tier is not pinned (the pinned budget, MemAvailable minus headroom and `ulimit -l`, cannot hold every expert of its layers beside the other chunks, or one expert is larger than --pinned-chunk-mib): misses copy from the mapped model file at the pageable rate (host_expert_gbps)",
                d.index
            ));
        }
    }
    out.extend(prefix_checkpoint_notes(plan));
    out.extend(embedding_copy_notes(plan));
    if plan.predicted.guessed {
        out.push("the predicted speeds are guesses: the probe lacks measured [device.cost] coefficients or [device.cost.types] rates for this model's weight types (defaults calibrated on the H200; the basis names them); `strata-exec probe` measures them".into());
        if plan.devices.iter().any(|d| {
            d.cost.miss_policy() != MissPolicy::None
                || d.cost.kv_host_policy(plan.serve.max_context) != KvHostPolicy::None
        }) {
            out.push("the miss policy and the KV host policy rest on the host keys `host_matvec_gbps`, `host_round_trip_us`, `kv_host_round_trip_us` and `eager_launch_us` of [device.cost] (defaults 40 GB/s, 600 us, 3500 us and 5 us: conservative guesses from the H200 machine that favour streaming); `strata-exec probe` measures them on this machine".into());
        }
        if plan.devices.iter().any(|d| d.cost.delta_token_s > 0.0) {
            out.push("Qwen3-Next's linear layers are priced with the delta-rule keys `delta_rule_token_us`, `delta_rule_latency_us` and `linear_state_gbps` of [device.cost] where the probe has them (GPU defaults 1 us a token a layer in prefill and 10 us a decode layer: guesses, never measured; the CPU's from its product rate); `strata-exec probe` measures them".into());
        }
    }
    out
}

/// Each copy of the token embedding on a device without the `embedding` region (the last
/// stage's, `ModelFacts::embedding_copy`): where it is counted and what reads it.
fn embedding_copy_notes(plan: &Plan) -> Vec<String> {
    plan.tensors
        .iter()
        .filter(|t| t.name == "token_embd.weight")
        .filter_map(|t| {
            let Placement::Device { device, offset } = t.placement else {
                return None;
            };
            let d = plan.devices.iter().find(|d| d.index == device)?;
            let r = d
                .regions
                .iter()
                .find(|r| (r.offset..r.offset + r.bytes).contains(&offset))?;
            let why = match r.kind {
                RegionKind::Embedding => return None,
                RegionKind::Mtp => "the MTP block embeds its draft tokens with it (the model has no `nextn.embed_tokens`)",
                _ => "the tied output head reads it",
            };
            Some(format!(
                "device {device}: a copy of `token_embd.weight` ({}) in its {} region: {why}; the first device holds the table",
                gib(t.bytes),
                r.kind.as_str()
            ))
        })
        .collect()
}

/// What the prefix checkpoint costs on each device that places one, or that it is off.
fn prefix_checkpoint_notes(plan: &Plan) -> Vec<String> {
    let slots = u64::from(plan.serve.batch.max(1));
    let linear = plan
        .devices
        .iter()
        .any(|d| d.region_bytes(RegionKind::LinearState) > 0);
    if linear && !plan.serve.prefix_checkpoint {
        return vec!["prefix checkpoint off (--no-prefix-checkpoint): the server's prefix cache reuses a slot of this model (linear attention) only when a new prompt extends the slot's whole context".into()];
    }
    plan.devices
        .iter()
        .filter(|d| d.region_bytes(RegionKind::PrefixCheckpoint) > 0)
        .map(|d| {
            let b = d.region_bytes(RegionKind::PrefixCheckpoint);
            format!(
                "device {}: prefix_checkpoint {} ({} a slot x {slots}): each slot's linear state at the end of its last prompt, so the server's prefix cache can rewind the slot there; --no-prefix-checkpoint frees it",
                d.index,
                gib(b),
                gib(b / slots)
            )
        })
        .collect()
}

fn point_json(p: &DecodePoint) -> Value {
    json!({
        "batch": p.batch,
        "context": p.context,
        "per_slot_tok_s": p.per_slot_tok_s,
        "aggregate_tok_s": p.aggregate_tok_s,
    })
}

fn cost_json(c: &DeviceCost) -> Value {
    json!({
        "step_s": c.step_s,
        "dense_read_s": c.dense_read_s,
        "rows_per_read": c.rows_per_read,
        "token_compute_s": c.token_compute_s,
        "head_compute_s": c.head_compute_s,
        "expert_layers": c.expert_layers,
        "expert_read_s": c.expert_read_s,
        "expert_pass_read_s": c.expert_pass_read_s,
        "expert_read_per_use": c.expert_read_per_use,
        "hit_rate": c.hit_rate,
        "expert_miss_s": c.expert_miss_s,
        "host_expert_s": c.host_expert_s,
        "host_layer_s": c.host_layer_s,
        "cpu_misses_per_token": c.cpu_misses_per_token,
        "kv_cell_s": c.kv_cell_s,
        "kv_host_cell_s": c.kv_host_cell_s,
        "kv_cpu_cell_s": c.kv_cpu_cell_s,
        "kv_cpu_step_s": c.kv_cpu_step_s,
        "eager_step_s": c.eager_step_s,
        "kv_host_cpu": c.kv_host_cpu,
        "row_s": c.row_s,
        "pass_s": c.pass_s,
        "prefill_gemm": c.prefill_gemm,
        "prefill_experts_per_use": c.prefill_experts_per_use,
        "prefill_token_s": c.prefill_token_s,
        "prefill_cell_s": c.prefill_cell_s,
    })
}

/// The JSON report of a plan.
pub fn plan_json(plan: &Plan) -> Value {
    let devices: Vec<Value> = plan
        .devices
        .iter()
        .map(|d| {
            let mut regions = Map::new();
            for k in RegionKind::ALL {
                regions.insert(k.as_str().into(), json!(d.region_bytes(k)));
            }
            let planned = d.planned_bytes();
            json!({
                "index": d.index,
                "name": d.name,
                "vendor": d.vendor,
                "arch": d.arch,
                "vram_bytes": d.vram_bytes,
                "planned_bytes": planned,
                "arena_bytes": d.arena_bytes,
                "free_bytes_after": d.vram_bytes.saturating_sub(planned),
                "layers": [d.layer_first, d.layer_end],
                "regions": regions,
                "expert_cache_slots": d.expert_cache_slots,
                "expert_slot_bytes": d.expert_slot_bytes,
                "miss_policy": d.cost.miss_policy().to_string(),
                "miss_policy_why": miss_policy_why(&d.cost),
                "kv_host": d.cost.kv_host_policy(plan.serve.max_context).to_string(),
                "slots": plan.serve.batch,
                "holds": {
                    "embedding": d.holds_embedding,
                    "head": d.holds_head,
                    "mtp": d.holds_mtp,
                    "vision": d.holds_vision,
                },
                "kv_layers": d.kv_layers,
                "free_bytes_probed": d.free_bytes_probed,
                "cost": cost_json(&d.cost),
                "handoff_in": d.handoff_in,
            })
        })
        .collect();
    let h = &plan.host;
    let s = &plan.serve;
    let mut v = json!({
        "feasible": true,
        "degraded": !plan.degradations.is_empty(),
        "runnable": runnable_json(&runnable(plan)),
        "model": {
            "name": plan.model.name,
            "arch": plan.model.arch,
            "source": plan.model.source,
            "fingerprint": plan.model.fingerprint,
            "total_bytes": plan.model.total_bytes,
        },
        "hardware_fingerprint": plan.hardware_fingerprint,
        "devices": devices,
        "host": {
            "pinned_bytes": h.pinned_bytes,
            "pinned_chunk_max_bytes": h.pinned_chunk_max_bytes,
            "pinned_chunks": h.pinned_chunks.len(),
            "experts_pinned_bytes": h
                .pinned_chunks
                .iter()
                .filter(|c| c.purpose == PINNED_EXPERTS)
                .map(|c| c.bytes)
                .sum::<u64>(),
            "kv_host_bytes": h.kv_host_bytes,
            "experts_host_bytes": h.experts_host_bytes,
            "ram_required_bytes": h.ram_required_bytes,
            "ram_available_bytes": h.ram_available_bytes,
            "ram_bytes": h.ram_bytes,
            "memlock_limit_bytes": h.memlock_limit_bytes,
            "experts_page_from_disk": h.experts_page_from_disk,
        },
        "serve": {
            "max_context": s.max_context,
            "batch": s.batch,
            "requested_batch": s.requested_batch,
            "kv": s.kv,
            "kv_resident": s.kv_resident,
            "requested_kv_resident": s.requested_kv_resident,
            "ubatch": s.ubatch,
            "mtp": s.mtp,
            "spec": s.spec,
            "vision": s.vision,
            "vram_reserve_bytes": s.vram_reserve_bytes,
            "expert_cache": s.expert_cache.to_string(),
            "expert_profile": s.expert_profile,
            "layer_split": s.layer_split,
            "layer_split_requested": s.layer_split_requested,
            "gpu": s.gpu,
            "pinned_chunk_bytes": s.pinned_chunk_bytes,
            "rope_scaling": if s.yarn.is_some() { "yarn" } else { "none" },
            "rope_scale": s.yarn.map_or(1.0, |y| y.factor),
            "yarn_orig_ctx": s.yarn.map(|y| y.orig_ctx),
        },
        "degradations": plan.degradations.iter().map(|d| json!({
            "what": d.what, "requested": d.requested, "planned": d.planned, "reason": d.reason,
        })).collect::<Vec<_>>(),
        "suggestions": plan.suggestions,
        "predicted": {
            "decode_tok_s": plan.predicted.decode_tok_s,
            "expert_hit_rate": plan.predicted.expert_hit_rate,
            "expert_hit_source": plan.predicted.expert_hit_source,
            "decode_empty": point_json(&plan.predicted.decode_empty),
            "decode_full": point_json(&plan.predicted.decode_full),
            "prefill_tok_s": plan.predicted.prefill_tok_s,
            "ubatch": s.ubatch,
            "guessed": plan.predicted.guessed,
            "basis": plan.predicted.basis,
        },
        "notes": notes(plan),
    });
    // Only two-file models carry the key, so single-file reports read as before.
    if let Some(m) = &plan.model.mtp_file {
        v["model"]["mtp_file"] = json!({ "source": m.source, "fingerprint": m.fingerprint });
    }
    v
}

/// The JSON report when no plan fits.
pub fn infeasible_json(inf: &Infeasible) -> Value {
    json!({
        "feasible": false,
        "devices": inf.devices.iter().map(|d| {
            let mut regions = Map::new();
            for (k, b) in &d.regions {
                regions.insert(k.as_str().into(), json!(b));
            }
            json!({
                "index": d.index,
                "name": d.name,
                "vram_bytes": d.vram_bytes,
                "planned_bytes": d.needed_bytes,
                "shortfall_bytes": d.shortfall_bytes,
                "free_bytes_after": d.vram_bytes.saturating_sub(d.needed_bytes),
                "layers": [d.layers.0, d.layers.1],
                "regions": regions,
                "expert_cache_slots": 0,
                "slots": 1,
            })
        }).collect::<Vec<_>>(),
        "host": { "shortfall_bytes": inf.host_shortfall_bytes },
        "reasons": inf.reasons,
        "degradations": [],
        "suggestions": inf.suggestions,
        "predicted": { "decode_tok_s": 0.0, "expert_hit_rate": 0.0 },
        "notes": [],
    })
}

/// Human report of a plan.
pub fn plan_text(plan: &Plan) -> String {
    let mut o = String::new();
    let s = &plan.serve;
    let run = runnable(plan);
    let verdict = if plan.degradations.is_empty() {
        "FEASIBLE".to_string()
    } else {
        format!(
            "DEGRADED ({}: see degradations; --strict refuses it)",
            plan.degradations
                .iter()
                .map(|d| d.what.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    let backends: Vec<&str> = run.backends().iter().map(|b| b.as_str()).collect();
    o.push_str(&format!(
        "strata-plan: {} ({}, {}) — {verdict}; {}\n",
        plan.model.name,
        plan.model.arch,
        gib(plan.model.total_bytes),
        if backends.is_empty() {
            "NOT RUNNABLE by this build's strata-exec (see runnable)".to_string()
        } else {
            format!("runnable on {}", backends.join(", "))
        }
    ));
    if let Some(m) = &plan.model.mtp_file {
        o.push_str(&format!(
            "  model: {} with its MTP block from {} (fingerprint {})\n",
            plan.model.source, m.source, m.fingerprint
        ));
    }
    o.push_str(&format!(
        "  serve: {} slot(s) x {} cells ({} in VRAM per slot), kv {}, ubatch {}, mtp {}{}, vision {}, split {}\n",
        s.batch,
        s.max_context,
        s.kv_resident,
        s.kv.as_str(),
        s.ubatch,
        if s.mtp { "on" } else { "off" },
        if s.spec > 0 { format!(" (spec {})", s.spec) } else { String::new() },
        if s.vision { "on" } else { "off" },
        if s.layer_split.is_empty() {
            "none".to_string()
        } else {
            s.layer_split.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",")
        }
    ));
    for d in &plan.devices {
        o.push_str(&device_text(d, plan.serve.max_context, plan.serve.batch));
    }
    let h = &plan.host;
    let host_experts = plan
        .tensors
        .iter()
        .filter(|t| matches!(t.placement, Placement::HostExperts { .. }))
        .count();
    o.push_str(&format!(
        "\n  host: pinned {} in {} chunk(s) of at most {} (KV beyond the VRAM window {}, host expert tier {}); non-resident experts {} mapped from the model file ({} expert tensors)\n",
        gib(h.pinned_bytes),
        h.pinned_chunks.len(),
        gib(h.pinned_chunk_max_bytes),
        gib(h.kv_host_bytes),
        gib(h
            .pinned_chunks
            .iter()
            .filter(|c| c.purpose == PINNED_EXPERTS)
            .map(|c| c.bytes)
            .sum()),
        gib(h.experts_host_bytes),
        host_experts,
    ));
    o.push_str(&format!(
        "  host RAM: needs {} of {} available ({} total){} — {}\n",
        gib(h.ram_required_bytes),
        gib(h.ram_available_bytes),
        gib(h.ram_bytes),
        h.memlock_limit_bytes
            .map(|m| format!(", memlock {}", gib(m)))
            .unwrap_or_default(),
        if plan.degradations.iter().any(|d| d.what == "host_ram") {
            "does NOT fit: strata-exec will refuse to start (see degradations)"
        } else if h.experts_page_from_disk {
            "does NOT fit: experts page from disk (see degradations)"
        } else {
            "fits"
        }
    ));
    o.push_str("\n  runnable by this build's strata-exec:\n");
    o.push_str(&runnable_text(&run));
    o.push_str(&predicted_text(plan));
    if plan.degradations.is_empty() {
        o.push_str("  degradations: none\n");
    } else {
        o.push_str("  degradations:\n");
        for d in &plan.degradations {
            o.push_str(&format!(
                "    - {}: requested {}, planned {} — {}\n",
                d.what, d.requested, d.planned, d.reason
            ));
        }
    }
    if !plan.suggestions.is_empty() {
        o.push_str("  suggestions:\n");
        for s in &plan.suggestions {
            o.push_str(&format!("    - {s}\n"));
        }
    }
    let notes = notes(plan);
    if !notes.is_empty() {
        o.push_str("  notes:\n");
        for n in &notes {
            o.push_str(&format!("    - {n}\n"));
        }
    }
    o
}

/// One device's section of the text report.
fn device_text(d: &DevicePlan, ctx: u64, batch: u32) -> String {
    let mut o = String::new();
    let planned = d.planned_bytes();
    o.push_str(&format!(
        "\n  device {} {} ({}): layers [{}, {}){}{}{}{}{}\n",
        d.index,
        d.name,
        gib(d.vram_bytes),
        d.layer_first,
        d.layer_end,
        if d.holds_embedding { " +embedding" } else { "" },
        if d.holds_head { " +head" } else { "" },
        if d.holds_mtp { " +mtp" } else { "" },
        if d.holds_vision { " +vision" } else { "" },
        match d.handoff_in.as_str() {
            "peer" => ", hidden state in by peer copy",
            "host" => ", hidden state in through pinned host memory",
            _ => "",
        },
    ));
    for r in &d.regions {
        if r.bytes > 0 {
            o.push_str(&format!(
                "    {:<16} {:>12}\n",
                r.kind.as_str(),
                gib(r.bytes)
            ));
        }
    }
    o.push_str(&format!(
        "    {:<16} {:>12}   ({} expert slots of {}; {} free after{})\n",
        "planned",
        gib(planned),
        d.expert_cache_slots,
        gib(d.expert_slot_bytes),
        gib(d.vram_bytes.saturating_sub(planned)),
        if d.free_bytes_probed || d.vendor == "cpu" {
            ""
        } else {
            "; free memory assumed, see notes"
        }
    ));
    let policy = d.cost.miss_policy();
    if policy != MissPolicy::None {
        o.push_str(&format!(
            "    {:<16} {:>12}   ({}; {})\n",
            "miss policy",
            policy.to_string(),
            match policy {
                MissPolicy::Cpu => "every missed expert computed on the host CPU beside the device's products".to_string(),
                MissPolicy::Split(n) => format!("up to {n} missed expert(s) a token per layer computed on the host CPU, the rest copied into the cache"),
                _ => "every missed expert copied into the cache".to_string(),
            },
            miss_policy_why(&d.cost),
        ));
    }
    o.push_str(&kv_host_text(d, ctx, batch));
    o
}

/// Why the miss policy: the predicted decode step (batch 1, empty context, where the cost
/// model chooses) of each option, and the round trip a host layer pays. Empty where nothing
/// misses.
pub fn miss_policy_why(c: &DeviceCost) -> String {
    if c.miss_policy() == MissPolicy::None {
        return String::new();
    }
    let at = |n: u32| {
        DeviceCost {
            cpu_misses_per_token: n,
            ..c.clone()
        }
        .decode_step_seconds(1, 0)
            * 1e3
    };
    let k = c.n_expert_used;
    let mut opts = vec![format!("stream {:.2} ms", at(0))];
    let chosen = c.cpu_misses_per_token.min(k);
    if chosen > 0 && chosen < k {
        opts.push(format!("split {chosen} {:.2} ms", at(chosen)));
    }
    opts.push(format!("cpu {:.2} ms", at(k)));
    format!(
        "a decode step predicted {} with a {:.0} us round trip a host layer; --miss-policy overrides",
        opts.join(", "),
        c.host_layer_s * 1e6
    )
}

/// The device's KV host policy line of the text report, with the two predicted costs it
/// chose between (empty where nothing spills).
fn kv_host_text(d: &DevicePlan, ctx: u64, batch: u32) -> String {
    let policy = d.cost.kv_host_policy(ctx);
    if policy == KvHostPolicy::None {
        return String::new();
    }
    let at = |cpu: bool| {
        DeviceCost {
            kv_host_cpu: cpu,
            ..d.cost.clone()
        }
        .decode_step_seconds(batch, ctx)
            * 1e3
    };
    let (cpu, stream) = (at(true), at(false));
    let host = ctx.saturating_sub(d.cost.kv_resident);
    let why = if policy == KvHostPolicy::Cpu {
        "the host CPU attends them while the device attends its window"
    } else {
        "the device reads them over PCIe"
    };
    format!(
        "    {:<16} {:>12}   ({host} cells a slot past --kv-resident: {why}; a decode step of {batch} slot(s) at full context predicted {cpu:.2} ms with the CPU's part, {stream:.2} ms streamed; --kv-host overrides)\n",
        "kv host",
        policy.to_string(),
    )
}

/// The predictions' section of the text report.
fn predicted_text(plan: &Plan) -> String {
    let mut o = String::new();
    let s = &plan.serve;
    let p = &plan.predicted;
    o.push_str(&format!(
        "  predicted{}:\n",
        if p.guessed {
            " (GUESSES: default [device.cost] coefficients or weight-type rates; see the basis)"
        } else {
            ""
        }
    ));
    for (label, d) in [
        ("empty context", &p.decode_empty),
        ("full context", &p.decode_full),
    ] {
        o.push_str(&format!(
            "    decode, {} slot(s), {label} ({} cells): {:.1} tok/s per slot, {:.1} tok/s in all\n",
            d.batch, d.context, d.per_slot_tok_s, d.aggregate_tok_s
        ));
    }
    o.push_str(&format!(
        "    prefill in passes of {} tokens: {:.0} tok/s; expert hit rate {:.1}% ({})\n    basis: {}\n",
        s.ubatch.min(s.max_context as u32),
        p.prefill_tok_s,
        p.expert_hit_rate * 100.0,
        p.expert_hit_source,
        p.basis
    ));
    o
}

/// Human report when nothing fits.
pub fn infeasible_text(inf: &Infeasible) -> String {
    let mut o =
        String::from("strata-plan: INFEASIBLE — the required items do not fit; no plan written\n");
    for r in &inf.reasons {
        o.push_str(&format!("  - {r}\n"));
    }
    for d in &inf.devices {
        o.push_str(&format!(
            "\n  device {} {}: layers [{}, {}), needs {} of {}{}\n",
            d.index,
            d.name,
            d.layers.0,
            d.layers.1,
            gib(d.needed_bytes),
            gib(d.vram_bytes),
            if d.shortfall_bytes > 0 {
                format!(
                    ", SHORT BY {} ({} bytes)",
                    gib(d.shortfall_bytes),
                    d.shortfall_bytes
                )
            } else {
                String::new()
            }
        ));
        for (k, b) in &d.regions {
            if *b > 0 {
                o.push_str(&format!("    {:<16} {:>12}\n", k.as_str(), gib(*b)));
            }
        }
    }
    if !inf.suggestions.is_empty() {
        o.push_str("\n  suggestions:\n");
        for s in &inf.suggestions {
            o.push_str(&format!("    - {s}\n"));
        }
    }
    o
}

/// Each device's working buffers as `strata-plan inspect` lists them: the pass they were
/// sized for and every named buffer's offset (inside the scratch region) and size.
pub fn scratch_json(plan: &Plan) -> Value {
    let devs: Vec<Value> = plan
        .devices
        .iter()
        .map(|d| {
            let p = d.work_pass;
            json!({
                "index": d.index,
                "pass": {
                    "tokens": p.tokens,
                    "logit_rows": p.logit_rows,
                    "att_splits": p.att_splits,
                    "slots": p.slots,
                    "gemm": p.gemm,
                },
                "buffers": d.scratch.iter().map(|b| json!({
                    "name": b.name,
                    "offset": b.offset,
                    "bytes": b.bytes,
                    "first_op": b.first_op,
                    "last_op": b.last_op,
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!(devs)
}

/// The text form of [`scratch_json`].
pub fn scratch_text(plan: &Plan) -> String {
    let mut out = String::new();
    for d in &plan.devices {
        let p = d.work_pass;
        if p.tokens == 0 {
            out.push_str(&format!(
                "  device {} scratch: the forward graph's estimate ({} buffers); no backend of this build binds it\n",
                d.index,
                d.scratch.len()
            ));
            continue;
        }
        out.push_str(&format!(
            "  device {} scratch: passes of {} tokens, {} logit rows, {} attention splits, {} slots{}\n",
            d.index,
            p.tokens,
            p.logit_rows,
            p.att_splits,
            p.slots,
            if p.gemm { ", tensor-core prefill" } else { "" }
        ));
        for b in &d.scratch {
            out.push_str(&format!(
                "    {:<10} at {:>12} {:>14} B\n",
                b.name, b.offset, b.bytes
            ));
        }
    }
    out
}
