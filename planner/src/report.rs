//! The feasibility report: human text and the JSON contract of DESIGN.md, built from a plan
//! (so `inspect` prints the same report back) or from an infeasible outcome.
//! Invariant: the JSON keys named in DESIGN.md are always present; text and JSON come from
//! the same numbers.

use crate::solve::{gib, Infeasible};
use serde_json::{json, Map, Value};
use strata_schemas::plan::{Placement, Plan, RegionKind};

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
                "slots": plan.serve.batch,
                "holds": {
                    "embedding": d.holds_embedding,
                    "head": d.holds_head,
                    "mtp": d.holds_mtp,
                    "vision": d.holds_vision,
                },
                "kv_layers": d.kv_layers,
                "predicted_token_seconds": d.predicted_token_seconds,
                "handoff_in": d.handoff_in,
            })
        })
        .collect();
    let h = &plan.host;
    let s = &plan.serve;
    json!({
        "feasible": true,
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
            "at_context": plan.predicted.at_context,
            "basis": plan.predicted.basis,
        },
    })
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
    })
}

/// Human report of a plan.
pub fn plan_text(plan: &Plan) -> String {
    let mut o = String::new();
    let s = &plan.serve;
    o.push_str(&format!(
        "strata-plan: {} ({}, {}) — FEASIBLE\n",
        plan.model.name,
        plan.model.arch,
        gib(plan.model.total_bytes)
    ));
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
            "    {:<16} {:>12}   ({} expert slots of {:.2} MiB; {} free after)\n",
            "planned",
            gib(planned),
            d.expert_cache_slots,
            d.expert_slot_bytes as f64 / (1u64 << 20) as f64,
            gib(d.vram_bytes.saturating_sub(planned)),
        ));
    }
    let h = &plan.host;
    let host_experts = plan
        .tensors
        .iter()
        .filter(|t| matches!(t.placement, Placement::HostExperts { .. }))
        .count();
    o.push_str(&format!(
        "\n  host: pinned {} in {} chunk(s) of at most {} (KV beyond the VRAM window {}); non-resident experts {} mapped from the model file ({} expert tensors)\n",
        gib(h.pinned_bytes),
        h.pinned_chunks.len(),
        gib(h.pinned_chunk_max_bytes),
        gib(h.kv_host_bytes),
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
        if h.experts_page_from_disk {
            "does NOT fit: experts page from disk (see degradations)"
        } else {
            "fits"
        }
    ));
    o.push_str(&format!(
        "\n  predicted: {:.1} tok/s decode, expert hit rate {:.1}% ({})\n",
        plan.predicted.decode_tok_s,
        plan.predicted.expert_hit_rate * 100.0,
        plan.predicted.basis
    ));
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
