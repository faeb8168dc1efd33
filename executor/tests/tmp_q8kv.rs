mod common;
use common::*;
use strata_exec::engine::Engine;
use strata_exec::load::open_model;
use strata_schemas::ggml::GgmlType;
use strata_schemas::serve::KvType;
fn run(e: &mut dyn Engine, prompt: &[u32]) -> Vec<f32> {
    let ub = e.info().ubatch;
    let mut logits = Vec::new();
    for chunk in prompt.chunks(ub) {
        logits.extend_from_slice(e.prefill_all(0, chunk).unwrap());
    }
    logits
}
fn rel_err(a: &[f32], b: &[f32], v: usize) -> f64 {
    let mut worst = 0f64;
    for (ra, rb) in a.chunks(v).zip(b.chunks(v)) {
        let scale = rb.iter().fold(0f64, |m, x| m.max(x.abs() as f64));
        for (x, y) in ra.iter().zip(rb) {
            worst = worst.max((*x as f64 - *y as f64).abs() / scale);
        }
    }
    worst
}
#[test]
fn tmp() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("tiny-q8_0.gguf");
    strata_schemas::gguf::write::convert_hf_folder(&data("base"), &gguf, GgmlType::Q8_0, None)
        .unwrap();
    let r = reference("base");
    let inv = strata_plan::model::load_model(&gguf).unwrap();
    let mut out = vec![];
    for kv in [KvType::F16, KvType::Q8_0] {
        let ask = Ask {
            kv,
            ..Ask::default()
        };
        let cp = plan_inventory("base", &inv, &gguf, &ask);
        let mut c = strata_exec::exec::PlanEngine::start(
            &cp,
            open_model(&gguf).unwrap(),
            strata_exec::exec::EngineOptions::default(),
        )
        .unwrap();
        let v = c.info().n_vocab;
        let mut per = vec![];
        for p in prompts(&r) {
            c.reset_slot(0);
            per.push(run(&mut c, &p));
        }
        out.push((per, v));
    }
    for i in 0..out[0].0.len() {
        eprintln!(
            "prompt {i}: CPU q8 KV vs CPU f16 KV {:e}",
            rel_err(&out[1].0[i], &out[0].0[i], out[0].1)
        );
    }
    // f32 weights
    let mut out2 = vec![];
    for kv in [KvType::F16, KvType::Q8_0] {
        let ask = Ask {
            kv,
            ..Ask::default()
        };
        let mut c = engine("base", &plan("base", &ask));
        let v = c.info().n_vocab;
        let mut per = vec![];
        for p in prompts(&r) {
            c.reset_slot(0);
            per.push(run(&mut c, &p));
        }
        out2.push((per, v));
    }
    for i in 0..out2[0].0.len() {
        eprintln!(
            "f32 weights prompt {i}: CPU q8 KV vs CPU f16 KV {:e}",
            rel_err(&out2[1].0[i], &out2[0].0[i], out2[0].1)
        );
    }
}
