//! Qwen3-Next on the CPU engine from a plan: a random tiny qwen3next GGUF planned on one and on
//! two CPU devices runs through `start_cpu`, decode with the linear state equals recomputing
//! the whole sequence, a layer split equals one stage, and the transformers references match
//! from the safetensors folder and from its GGUF conversion.

mod common;

use common::{check_references, max_rel, plan_folder, plan_folder_ctx, tiny_qwen3next_hp};
use strata_exec::engine::Engine;
use strata_exec::exec::{start_cpu, EngineOptions};
use strata_exec::load::{GgufModel, SafetensorsModel};
use strata_schemas::arch::QuantRecipe;
use strata_schemas::ggml::GgmlType;
use strata_schemas::gguf::convert::convert_hf_folder;
use strata_schemas::gguf::random::{write_random_model, RandomOptions};
use strata_schemas::plan::RegionKind;
use strata_schemas::serve::ExpertCache;

#[test]
fn a_random_qwen3next_gguf_runs_from_a_plan_and_decode_equals_recompute() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("next.gguf");
    let hp = tiny_qwen3next_hp();
    let recipe = QuantRecipe::preset("F32").unwrap();
    let opts = RandomOptions {
        name: "tiny next".into(),
        ..Default::default()
    };
    write_random_model(&path, "qwen3next", &hp, &recipe, 5, opts).unwrap();
    let v = hp.n_vocab as usize;
    // plan_folder plans ubatch 8: one prefill call takes at most 8 tokens.
    let prompt: Vec<u32> = (0..8u32).map(|i| (i * 53 + 7) % 128).collect();

    let one = plan_folder(&path, 1, None, ExpertCache::Off, None);
    assert!(
        one.devices[0].region_bytes(RegionKind::LinearState) > 0,
        "the plan holds linear state"
    );
    let mut e = start_cpu(
        &one,
        Box::new(GgufModel::open(&path).unwrap()),
        EngineOptions::default(),
    )
    .unwrap();
    let all = e.prefill_all(0, &prompt).unwrap().to_vec();
    assert!(all.iter().all(|x| x.is_finite()));
    e.reset_slot(0);
    let first = e.prefill(0, &prompt[..5], true).unwrap().unwrap().to_vec();
    assert!(max_rel(&first, &all[4 * v..5 * v]) < 1e-4);
    for (i, &t) in prompt[5..].iter().enumerate() {
        let got = e.decode(&[(0, t)]).unwrap().to_vec();
        let at = 5 + i;
        let r = max_rel(&got, &all[at * v..(at + 1) * v]);
        assert!(r < 1e-4, "decode at {at} differs by {r}");
    }

    // Two stages (linear and full layers on each) give the same logits.
    let two = plan_folder(&path, 2, Some(vec![2]), ExpertCache::Off, None);
    let mut e2 = start_cpu(
        &two,
        Box::new(GgufModel::open(&path).unwrap()),
        EngineOptions::default(),
    )
    .unwrap();
    assert_eq!(e2.stages().len(), 2);
    let all2 = e2.prefill_all(1, &prompt).unwrap().to_vec();
    let r = max_rel(&all2, &all);
    assert!(r < 1e-5, "a layer split differs by {r}");
}

/// The transformers references (scripts/make_reference_next.py, committed in
/// tests/data/tiny-qwen3next): each HF folder run directly (its converted tensors built on
/// load) and converted to GGUF (F32, as `strata-gguf convert` writes it), each on the CPU
/// engine, with the logits of every prompt position within 1e-4 of the largest logit of
/// transformers run with an f16 cache (1e-3 of its plain float32 run), and the greedy
/// continuation (with the KV cache and the linear state) token for token. The `cuda`
/// variant has the shapes the CUDA kernels take (`cuda_next` runs it there).
#[test]
fn tiny_qwen3next_references_match_from_the_folder_and_after_conversion() {
    let root =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/tiny-qwen3next");
    let tmp = tempfile::tempdir().unwrap();
    let mut runs = 0;
    for variant in ["base", "interval2", "odd", "cuda"] {
        let dir = root.join(variant);
        let r: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("reference.json")).unwrap()).unwrap();
        let gguf = tmp.path().join(format!("{variant}.gguf"));
        convert_hf_folder(&dir, &gguf, GgmlType::F32, None).unwrap();
        let sources: [(&str, &std::path::Path); 2] = [("folder", &dir), ("gguf", &gguf)];
        for (kind, path) in sources {
            let plan = plan_folder_ctx(path, 1, None, ExpertCache::Off, None, 128);
            let model: Box<dyn strata_exec::load::HostModel> = if kind == "folder" {
                Box::new(SafetensorsModel::open(path).unwrap())
            } else {
                Box::new(GgufModel::open(path).unwrap())
            };
            let mut e = start_cpu(&plan, model, EngineOptions::default()).unwrap();
            // Tolerance: 1e-4 of the largest logit from transformers with an f16 cache. Both
            // are f32 elsewhere (typically 1e-6 apart), but where the two f32 paths differ in
            // the last bit an f16 rounding of a K or V element can flip by one ulp (measured:
            // 4.2e-5 on interval2's third prompt).
            check_references(&format!("{variant} ({kind})"), &mut e, &r, 1e-4);
            runs += 1;
        }
    }
    assert_eq!(runs, 8);
}

/// Every tensor a Qwen3-Next folder gives the engine (1:1 from the mmap, converted on load,
/// or stacked) holds the bytes `strata-gguf convert` writes for it (F32 folder, F32 GGUF).
#[test]
fn the_folder_loader_gives_the_converters_bytes_for_every_tensor() {
    use strata_exec::load::HostModel;
    let root =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/tiny-qwen3next");
    let tmp = tempfile::tempdir().unwrap();
    for variant in ["base", "interval2", "odd", "cuda"] {
        let dir = root.join(variant);
        let gguf = tmp.path().join(format!("{variant}.gguf"));
        convert_hf_folder(&dir, &gguf, GgmlType::F32, None).unwrap();
        let (f, g) = (
            SafetensorsModel::open(&dir).unwrap(),
            GgufModel::open(&gguf).unwrap(),
        );
        let names: Vec<&str> = g
            .inventory()
            .tensors
            .iter()
            .map(|t| t.name.as_str())
            .collect();
        assert!(
            names.iter().any(|n| n.ends_with("ssm_a")),
            "{variant}: {names:?}"
        );
        for name in names {
            let fb = f
                .tensor_bytes(name)
                .unwrap_or_else(|| panic!("{variant}: the folder lacks `{name}`"));
            assert!(
                fb == g.tensor_bytes(name).unwrap(),
                "{variant}: `{name}` differs between the folder and its conversion"
            );
        }
    }
}
