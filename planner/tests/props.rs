//! Property tests of the planner: for random models, hardware and flags, every device's
//! regions fit its memory without overlap, the verifier accepts the scratch packing, tensors
//! sit inside their regions, the plan file round-trips byte for byte, and the report does not
//! lie (FEASIBLE only without degradations, runnable only as the capability table says,
//! predictions that slow down with the context and speed up in total with the batch), and a
//! profile's LRU reuse curve is the hit rate a one-device plan predicts at its slots.

use proptest::prelude::*;
use strata_plan::solve::{solve, Outcome, PlanRequest};
use strata_plan::testing::probe;
use strata_plan::verify::verify_device;
use strata_schemas::arch::{expected_tensors, QuantRecipe, PRESETS};
use strata_schemas::inventory::{HParams, ModelInventory, SsmParams};
use strata_schemas::plan::{Placement, Plan, RegionKind};
use strata_schemas::planfile::{plan_to_bytes, read_plan_bytes};
use strata_schemas::profile::{ExpertProfile, Reuse, ReuseHistogram};
use strata_schemas::serve::{ExpertCache, KvType, LayerSplit, ServeSettings};

const MIB: u64 = 1 << 20;

fn hparams() -> impl Strategy<Value = (String, HParams)> {
    (
        prop::bool::ANY,
        2u32..12,
        prop::sample::select(vec![256u64, 512]),
        prop::sample::select(vec![(4u64, 2u64, 64u64), (8, 2, 32), (4, 4, 128)]),
        prop::sample::select(vec![4u64, 8, 16]),
        1u64..4,
        prop::sample::select(vec![256u64, 512]),
        prop::bool::ANY,
        2u32..5,
    )
        .prop_map(
            |(next, n_layer, n_embd, (nh, nkv, hd), n_expert, used, ff, mtp, interval)| {
                let hp = HParams {
                    n_layer,
                    n_embd,
                    n_vocab: 1024,
                    n_ctx_train: 32768,
                    n_head: nh,
                    n_head_kv: nkv,
                    head_dim_k: hd,
                    head_dim_v: hd,
                    n_ff: 0,
                    n_expert,
                    n_expert_used: used.min(n_expert),
                    n_ff_exp: ff,
                    n_ff_shexp: if next { ff } else { 0 },
                    n_leading_dense: 0,
                    full_attention_interval: next.then_some(interval),
                    ssm: next.then_some(SsmParams {
                        conv_kernel: 4,
                        state_size: 32,
                        group_count: 2,
                        time_step_rank: 4,
                        inner_size: 128,
                    }),
                    nextn_predict_layers: u32::from(next && mtp),
                    rope_theta: 1e6,
                    rope_dim: None,
                    rms_eps: 1e-6,
                    norm_topk_prob: true,
                    tied_embeddings: false,
                };
                (
                    (if next { "qwen3next" } else { "qwen3moe" }).to_string(),
                    hp,
                )
            },
        )
}

fn settings(n_layer: u32, n_dev: usize, has_mtp: bool) -> impl Strategy<Value = ServeSettings> {
    (
        prop::sample::select(vec![256u64, 1024, 4096, 16384]),
        1u32..6,
        prop::bool::ANY,
        prop::option::of(1u64..16384),
        prop::sample::select(vec![16u32, 64, 512]),
        prop::bool::ANY,
        prop::sample::select(vec![0u64, 64]),
        prop::sample::select(vec![
            ExpertCache::Auto,
            ExpertCache::Off,
            ExpertCache::Slots(7),
        ]),
        prop::bool::ANY,
        prop::sample::select(vec![1u64, 4, 256]),
        prop::collection::vec(1u32..64, n_dev.saturating_sub(1)),
    )
        .prop_map(
            move |(ctx, batch, q8, res, ubatch, mtp, reserve, cache, auto, chunk, cuts)| {
                let mut bounds: Vec<u32> = cuts.iter().map(|c| 1 + c % (n_layer - 1)).collect();
                bounds.sort_unstable();
                bounds.dedup();
                let split = if auto || bounds.len() + 1 != n_dev {
                    LayerSplit::Auto
                } else {
                    LayerSplit::Bounds(bounds)
                };
                ServeSettings {
                    max_context: ctx,
                    batch,
                    kv: if q8 { KvType::Q8_0 } else { KvType::F16 },
                    kv_resident: res.map(|r| r.min(ctx)),
                    ubatch,
                    mtp: mtp && has_mtp,
                    spec: if mtp && has_mtp { 2 } else { 0 },
                    vram_reserve_mib: reserve,
                    expert_cache: cache,
                    layer_split: split,
                    pinned_chunk_mib: chunk,
                    ..Default::default()
                }
            },
        )
}

fn case() -> impl Strategy<Value = (ModelInventory, Vec<(u64, f64)>, u64, ServeSettings)> {
    (hparams(), prop::sample::select(PRESETS.to_vec()), 1usize..5).prop_flat_map(
        |((arch, hp), preset, n_dev)| {
            let n_dev = n_dev.min(hp.n_layer as usize);
            let recipe = QuantRecipe::preset(preset).expect("preset");
            let inv = ModelInventory {
                arch: arch.clone(),
                name: format!("{arch}-{preset}"),
                tensors: expected_tensors(&arch, &hp, &recipe).expect("valid hparams"),
                hparams: hp.clone(),
                vision: None,
            };
            (
                Just(inv),
                prop::collection::vec(
                    (
                        prop::sample::select(vec![768 * MIB, 1024 * MIB, 2048 * MIB, 6144 * MIB]),
                        50.0f64..2000.0,
                    ),
                    n_dev,
                ),
                prop::sample::select(vec![2u64 << 30, 8 << 30, 64 << 30]),
                settings(hp.n_layer, n_dev, hp.nextn_predict_layers > 0),
            )
        },
    )
}

fn check_plan(plan: &Plan) {
    for d in &plan.devices {
        verify_device(d).expect("regions fit without overlap; scratch packing verified");
        assert!(d.planned_bytes() <= d.vram_bytes);
        for r in &d.regions {
            if r.kind.in_arena() {
                assert!(
                    r.offset + r.bytes <= d.arena_bytes,
                    "{:?} outside the arena",
                    r.kind
                );
            }
        }
        assert_eq!(d.expert_cache_slots, d.resident_experts.len() as u64);
        let mut seen = std::collections::BTreeSet::new();
        for e in &d.resident_experts {
            assert!(e.layer >= d.layer_first && e.layer < d.layer_end);
            assert!(seen.insert((e.layer, e.expert)), "an expert resident twice");
        }
        // Tensors on this device: inside one weight region each, never overlapping.
        let mut spans: Vec<(u64, u64, &str)> = plan
            .tensors
            .iter()
            .filter_map(|t| match t.placement {
                Placement::Device { device, offset } if device == d.index => {
                    Some((offset, offset + t.bytes, t.name.as_str()))
                }
                _ => None,
            })
            .collect();
        spans.sort();
        for w in spans.windows(2) {
            assert!(
                w[0].1 <= w[1].0,
                "tensors {} and {} overlap",
                w[0].2,
                w[1].2
            );
        }
        for (a, b, name) in &spans {
            let inside = d.regions.iter().any(|r| {
                matches!(
                    r.kind,
                    RegionKind::DenseWeights
                        | RegionKind::Embedding
                        | RegionKind::Head
                        | RegionKind::Mtp
                ) && *a >= r.offset
                    && *b <= r.offset + r.bytes
            });
            assert!(inside, "tensor {name} is outside every weight region");
        }
    }
    let layers: u32 = plan
        .devices
        .iter()
        .map(|d| d.layer_end - d.layer_first)
        .sum();
    assert_eq!(
        layers, plan.model.n_layer,
        "every layer on exactly one device"
    );
    assert!(plan
        .host
        .pinned_chunks
        .iter()
        .all(|c| c.bytes <= plan.serve.pinned_chunk_bytes.max(4096)));
    let bytes = plan_to_bytes(plan).expect("serializes");
    let back = read_plan_bytes(&bytes).expect("reads back");
    assert_eq!(&back, plan, "plan round-trips");
    check_report(plan);
}

/// The report's claims against the plan.
fn check_report(plan: &Plan) {
    use strata_schemas::capability::{runnable, Backend};
    let text = strata_plan::report::plan_text(plan);
    let header = text.lines().next().unwrap();
    let fits = header.contains("FEASIBLE");
    assert_eq!(fits, plan.degradations.is_empty(), "{header}");
    if plan.host.experts_page_from_disk {
        assert!(!fits, "FEASIBLE over experts paging from disk: {header}");
        assert!(plan.degradations.iter().any(|d| d.what == "experts_in_ram"));
    }
    let run = runnable(plan);
    // The table's hard facts, independent of how `check` words them.
    let spill = plan.serve.kv_resident < plan.serve.max_context;
    // Pinned KV chunks of the most-spilling device (the GPU kernels address 128 a device).
    let spill_chunks = plan
        .devices
        .iter()
        .map(|d| {
            let c = plan.host.pinned_chunks.iter();
            c.filter(|c| c.device == d.index && c.purpose == "kv_spill")
                .count()
        })
        .max()
        .unwrap_or(0);
    if run.of(Backend::Cuda).is_ok() {
        // Experts in host memory run through the CUDA expert cache, spilled KV through mapped
        // pinned chunks.
        let arch = plan.model.arch.as_str();
        assert!(matches!(arch, "qwen3moe" | "qwen3next") && (!spill || spill_chunks <= 128));
        assert!(plan.devices.iter().all(|d| d.vendor == "nvidia"));
    }
    if run.of(Backend::Cpu).is_ok() {
        assert!(matches!(plan.model.arch.as_str(), "qwen3moe" | "qwen3next"));
        assert!(plan.devices.iter().all(|d| d.vendor == "cpu"));
    }
    if run.of(Backend::Hip).is_ok() {
        // The HIP build runs the CUDA engine's plans on AMD devices.
        let arch = plan.model.arch.as_str();
        assert!(matches!(arch, "qwen3moe" | "qwen3next") && (!spill || spill_chunks <= 128));
        assert!(plan.devices.iter().all(|d| d.vendor == "amd"));
    }
    assert_eq!(header.contains("NOT RUNNABLE"), !run.any(), "{header}");
    let j = strata_plan::report::plan_json(plan);
    for b in ["cpu", "cuda", "hip"] {
        let v = &j["runnable"][b];
        assert!(
            v == true || v.as_array().is_some_and(|a| !a.is_empty()),
            "{b}: {v}"
        );
    }
    // Predictions: positive, slower at full context, more in total at the planned batch.
    let p = &plan.predicted;
    assert!(p.decode_tok_s > 0.0 && p.prefill_tok_s > 0.0, "{p:?}");
    assert!(p.decode_full.per_slot_tok_s <= p.decode_empty.per_slot_tok_s);
    let b = plan.serve.batch;
    if b > 1 {
        let one = 1.0 / plan.decode_step_seconds(1, 0);
        assert!(
            p.decode_empty.aggregate_tok_s >= one * 0.999,
            "{p:?} vs {one}"
        );
        assert!(p.decode_empty.per_slot_tok_s <= one * 1.001);
    }
}

/// Every device of a model a backend of this build runs binds exactly that backend's working
/// set at the planned pass: each named buffer is in the plan, at least as large as
/// `workset::buffers` says, inside the scratch region.
fn check_workset(plan: &Plan, inv: &ModelInventory) {
    use strata_schemas::dims::Dims;
    use strata_schemas::workset::{buffers, runs, BackendKind, Pass};
    for d in &plan.devices {
        let be = BackendKind::for_vendor(&d.vendor);
        if !runs(be, &inv.arch, &inv.hparams) {
            assert_eq!(d.work_pass.tokens, 0, "device {}", d.index);
            continue;
        }
        let w = d.work_pass;
        let s = &plan.serve;
        assert!(w.tokens as u64 >= u64::from(s.ubatch).max(u64::from(s.batch)));
        let pass = Pass {
            tokens: w.tokens as usize,
            logit_rows: w.logit_rows as usize,
            att_splits: w.att_splits as usize,
            slots: w.slots as usize,
            gemm: w.gemm,
            mtp: d.holds_mtp,
        };
        let n_layer = (d.layer_end - d.layer_first) as usize;
        let region = d.region_bytes(RegionKind::Scratch);
        let f32_norms = inv
            .tensors
            .iter()
            .filter(|t| t.name.ends_with("norm.weight"))
            .all(|t| t.ggml_type == strata_schemas::ggml::GgmlType::F32);
        for (b, need) in buffers(be, &Dims::of(&inv.hparams), n_layer, f32_norms, &pass) {
            let got = d
                .scratch
                .iter()
                .find(|s| s.name == b.name())
                .unwrap_or_else(|| panic!("device {}: no `{}` buffer", d.index, b.name()));
            assert!(
                got.bytes >= need,
                "device {}: {} {} < {need}",
                d.index,
                b.name(),
                got.bytes
            );
            assert!(
                got.offset + got.bytes <= region,
                "device {}: {} outside",
                d.index,
                b.name()
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn random_requests_plan_soundly((inv, devs, ram, s) in case()) {
        let probe = probe(&devs, ram, ram - ram / 8);
        let req = PlanRequest {
            inventory: &inv,
            model_source: "prop".into(),
            probe: &probe,
            probe_source: "prop.toml".into(),
            settings: &s,
            profile: None,
            vision: None,
            mtp_file: None,
        };
        match solve(&req) {
            Ok(Outcome::Planned(plan)) => {
                check_plan(&plan);
                check_workset(&plan, &inv);
                prop_assert!(plan.serve.batch >= 1 && plan.serve.batch <= s.batch);
                // Deterministic: the same request gives the same bytes.
                let again = match solve(&req) { Ok(Outcome::Planned(p)) => p, _ => panic!("second solve differs") };
                prop_assert_eq!(plan_to_bytes(&plan).unwrap(), plan_to_bytes(&again).unwrap());
            }
            Ok(Outcome::Infeasible(inf)) => {
                prop_assert!(
                    inf.devices.iter().any(|d| d.shortfall_bytes > 0) || inf.host_shortfall_bytes > 0 || !inf.reasons.is_empty(),
                    "infeasible without a stated shortfall"
                );
            }
            Err(e) => prop_assert!(false, "valid request rejected: {}", e),
        }
    }
}

/// A profile of `inv`'s shape whose decode reuse histogram is `dense` (distances clipped to
/// the key space) and whose counts are uniform.
fn profile_with_curve(inv: &ModelInventory, dense: &[u64]) -> ExpertProfile {
    let hp = &inv.hparams;
    let mut p = ExpertProfile::uniform(hp.n_layer, hp.n_expert as u32);
    let keys = p.keys() as usize;
    p.reuse = Some(Reuse {
        decode: ReuseHistogram::from_dense(3, &dense[..dense.len().min(keys)]),
        prefill: ReuseHistogram::default(),
    });
    p
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// One device, `--expert-cache S` below every expert, a profile with reuse: the plan's
    /// hit rate is the curve at S and the report says it was measured; without the profile
    /// the report calls its hit rate a guess.
    #[test]
    fn a_profile_curve_is_the_predicted_hit_rate(
        ((arch, hp), frac, dense) in (
            hparams(),
            0.05f64..0.95,
            prop::collection::vec(0u64..1000, 1..200),
        ),
    ) {
        let recipe = QuantRecipe::preset("Q8_0").expect("preset");
        let inv = ModelInventory {
            arch: arch.clone(),
            name: arch.clone(),
            tensors: expected_tensors(&arch, &hp, &recipe).expect("valid hparams"),
            hparams: hp.clone(),
            vision: None,
        };
        let all = u64::from(hp.n_layer) * hp.n_expert;
        let slots = ((all as f64 * frac) as u64).max(2 * hp.n_expert_used).min(all - 1);
        let profile = profile_with_curve(&inv, &dense);
        prop_assume!(profile.reuse.as_ref().is_some_and(|r| r.decode.reuses() > 0));
        let probe = probe(&[(64 << 30, 1000.0)], 64 << 30, 60 << 30);
        let s = ServeSettings {
            max_context: 1024,
            batch: 1,
            expert_cache: ExpertCache::Slots(slots),
            ..ServeSettings::default()
        };
        let plan_with = |profile: Option<&ExpertProfile>| {
            let req = PlanRequest {
                inventory: &inv,
                model_source: "prop".into(),
                probe: &probe,
                probe_source: "prop.toml".into(),
                settings: &s,
                profile,
                vision: None,
                mtp_file: None,
            };
            match solve(&req) {
                Ok(Outcome::Planned(plan)) => plan,
                other => panic!("64 GiB does not plan a small model: {:?}", other.map(|_| ())),
            }
        };
        let plan = plan_with(Some(&profile));
        prop_assert_eq!(plan.devices[0].expert_cache_slots, slots);
        let want = profile.reuse.as_ref().and_then(|r| r.decode.hit_rate(slots as f64)).unwrap_or(0.0);
        prop_assert!((plan.predicted.expert_hit_rate - want).abs() < 1e-9,
            "plan {} vs curve {}", plan.predicted.expert_hit_rate, want);
        prop_assert!((plan.devices[0].cost.hit_rate - want).abs() < 1e-9);
        prop_assert!(plan.predicted.expert_hit_source.starts_with("measured"), "{}", plan.predicted.expert_hit_source);
        let guess = plan_with(None);
        prop_assert!(guess.predicted.expert_hit_source.starts_with("a guess"), "{}", guess.predicted.expert_hit_source);
    }
}
