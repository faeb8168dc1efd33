//! End-to-end tests that `strata-plan`'s report tells the truth (issue 21): which backend of
//! this build runs the plan and what is missing, `--strict` on plans nobody runs and on every
//! degradation (expert residency lost to the batch, experts paging from disk), the memlock
//! advice, readable numbers, `model-info`'s verdict and the catalogue check.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn plan_cmd(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata-plan"))
        .current_dir(root())
        .args(args)
        .output()
        .expect("strata-plan runs")
}

fn json_of(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}):\n{}\nstderr:\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn err(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

const Q8: &str = "plans/models/qwen3-30b-a3b-q8_0.toml";
const Q4KM: &str = "plans/models/qwen3-30b-a3b-q4_k_m.toml";

/// The README's first command: a plan that fits, which no backend of this build runs.
const README_FIRST: &[&str] = &[
    "--hardware",
    "plans/hardware/r9700-x2.toml",
    "--model",
    "plans/models/qwen3-next-80b-a3b-iq3_s.toml",
    "--max-context",
    "1048576",
    "--rope-scaling",
    "yarn",
    "--rope-scale",
    "4",
    "--yarn-orig-ctx",
    "262144",
    "--kv",
    "q8_0",
    "--kv-resident",
    "32768",
    "--batch",
    "4",
    "--mtp",
    "--spec",
    "4",
    "--vision",
    "--vram-reserve-mib",
    "500",
];

fn with(base: &[&str], more: &[&str]) -> Vec<String> {
    base.iter().chain(more).map(|s| s.to_string()).collect()
}

fn run(args: &[String]) -> Output {
    plan_cmd(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

fn reasons<'a>(j: &'a Value, backend: &str) -> Vec<&'a str> {
    j["runnable"][backend]
        .as_array()
        .unwrap_or_else(|| panic!("{backend} reported runnable: {}", j["runnable"]))
        .iter()
        .map(|r| r.as_str().unwrap())
        .collect()
}

#[test]
fn the_readme_plan_says_no_backend_runs_it_and_strict_refuses_it() {
    let j = json_of(&run(&with(README_FIRST, &["--format", "json"])));
    assert_eq!(j["feasible"], true);
    for (b, needles) in [
        // The CPU and CUDA engines run the MTP block (speculative decoding), over KV that
        // spills past --kv-resident too.
        ("cpu", &["vendor `amd`", "vision"][..]),
        ("cuda", &["vendor `amd`", "vision"][..]),
    ] {
        let r = reasons(&j, b).join("\n");
        for needle in needles {
            assert!(r.contains(needle), "{b} lacks `{needle}`:\n{r}");
        }
        assert!(!r.contains("MTP"), "{b} runs the MTP block:\n{r}");
    }
    // Both engines read every ggml type the CPU reference decodes (IQ3_S, Q6_K included).
    for b in ["cpu", "cuda"] {
        assert!(!reasons(&j, b).iter().any(|r| r.contains("weight type")));
    }
    // The GPU engines keep the KV beyond --kv-resident in mapped pinned chunks.
    assert!(!reasons(&j, "cuda").iter().any(|r| r.contains("kv_spill")));
    // The HIP build runs AMD devices and the MTP block (the CUDA stage's passes), but not
    // this plan's vision tower: that is its one reason.
    let hip = reasons(&j, "hip");
    assert_eq!(hip, ["the vision tower (--vision)"], "{hip:?}");
    let hip = hip.join("\n");
    assert!(!hip.contains("kv_spill"), "{hip}");
    assert!(!hip.contains("vendor `amd`"), "{hip}");

    let out = run(&with(README_FIRST, &[]));
    let t = text(&out);
    assert!(t.lines().next().unwrap().contains("NOT RUNNABLE"), "{t}");
    assert!(t.contains("runnable by this build's strata-exec:"), "{t}");

    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("x.plan");
    let out = run(&with(
        README_FIRST,
        &["--strict", "-o", plan.to_str().unwrap()],
    ));
    assert_eq!(out.status.code(), Some(3), "{}", err(&out));
    assert!(!plan.exists(), "--strict wrote a plan no backend runs");
    assert!(
        err(&out).contains("no backend of this build"),
        "{}",
        err(&out)
    );
}

#[test]
fn an_h200_q8_0_plan_is_runnable_on_cuda_and_predicts_the_measured_speed() {
    let out = plan_cmd(&[
        "--hardware",
        "plans/hardware/h200.toml",
        "--model",
        Q8,
        "--max-context",
        "4096",
        "--format",
        "json",
        "--strict",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", err(&out));
    let j = json_of(&out);
    assert_eq!(j["runnable"]["cuda"], true);
    assert!(reasons(&j, "cpu")[0].contains("vendor `nvidia`"));
    // BENCHMARKS.md: 261-266 tok/s decode, 15,100-15,300 tok/s pp512 on this configuration.
    let p = &j["predicted"];
    let tg = p["decode_tok_s"].as_f64().unwrap();
    let pp = p["prefill_tok_s"].as_f64().unwrap();
    assert!((tg / 262.0 - 1.0).abs() < 0.15, "decode {tg}");
    assert!((pp / 15_171.0 - 1.0).abs() < 0.15, "prefill {pp}");
    assert_eq!(p["guessed"], true);
    assert!(j["notes"][0]
        .as_str()
        .unwrap()
        .contains("strata-exec probe"));
    // A batch of 16 is not the batch-1 figure.
    let j16 = json_of(&plan_cmd(&[
        "--hardware",
        "plans/hardware/h200.toml",
        "--model",
        Q8,
        "--max-context",
        "4096",
        "--batch",
        "16",
        "--format",
        "json",
    ]));
    let e16 = &j16["predicted"]["decode_empty"];
    assert_eq!(e16["batch"], 16);
    assert!(e16["per_slot_tok_s"].as_f64().unwrap() < 0.8 * tg, "{e16}");
    assert!(e16["aggregate_tok_s"].as_f64().unwrap() > 2.0 * tg, "{e16}");
    let full = j16["predicted"]["decode_full"]["per_slot_tok_s"]
        .as_f64()
        .unwrap();
    assert!(full < e16["per_slot_tok_s"].as_f64().unwrap());
}

#[test]
fn a_batch_that_costs_expert_residency_is_a_degradation_strict_catches() {
    // Issue 21: 64 slots on three 12 GB cards shrink the expert cache to half of what one
    // slot gets; that used to print "degradations: none".
    let args = [
        "--hardware",
        "plans/hardware/rtx3060-x3.toml",
        "--model",
        Q4KM,
        "--batch",
        "64",
        "--format",
        "json",
    ];
    let j = json_of(&plan_cmd(&args));
    let d = j["degradations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["what"] == "expert_residency")
        .unwrap_or_else(|| panic!("no expert_residency in {}", j["degradations"]));
    assert!(d["requested"].as_str().unwrap().contains("100.0%"), "{d}");
    assert!(d["planned"].as_str().unwrap().contains('%'), "{d}");
    assert!(d["reason"].as_str().unwrap().contains("--batch 1"), "{d}");
    let mut strict = args.to_vec();
    strict.push("--strict");
    let out = plan_cmd(&strict);
    assert_eq!(out.status.code(), Some(3));
    assert!(err(&out).contains("expert_residency"), "{}", err(&out));
    // One slot keeps every expert: no degradation.
    let one = json_of(&plan_cmd(&[
        "--hardware",
        "plans/hardware/rtx3060-x3.toml",
        "--model",
        Q4KM,
        "--format",
        "json",
    ]));
    assert_eq!(one["degradations"], serde_json::json!([]));
}

fn probe_with_host(dir: &Path, base: &str, host: &str) -> String {
    let text = std::fs::read_to_string(root().join(base)).unwrap();
    let start = text.find("[host]").unwrap();
    let end = start + text[start..].find("[[device]]").unwrap();
    let out = format!("{}{host}\n\n{}", &text[..start], &text[end..]);
    let p = dir.join(Path::new(base).file_name().unwrap());
    std::fs::write(&p, out).unwrap();
    p.display().to_string()
}

#[test]
fn experts_paging_from_disk_is_never_feasible_and_strict_refuses_it() {
    let dir = tempfile::tempdir().unwrap();
    let hw = probe_with_host(
        dir.path(),
        "plans/hardware/rtx3060.toml",
        "[host]\nram_bytes = 17179869184\navailable_bytes = 12884901888",
    );
    let out = plan_cmd(&["--hardware", &hw, "--model", Q8, "--max-context", "4096"]);
    let t = text(&out);
    let header = t.lines().next().unwrap();
    assert!(!header.contains("FEASIBLE"), "{header}");
    assert!(
        header.contains("DEGRADED") && header.contains("experts_in_ram"),
        "{header}"
    );
    assert!(t.contains("does NOT fit: experts page from disk"), "{t}");
    let out = plan_cmd(&[
        "--hardware",
        &hw,
        "--model",
        Q8,
        "--max-context",
        "4096",
        "--strict",
    ]);
    assert_eq!(out.status.code(), Some(3));
}

#[test]
fn a_small_memlock_limit_is_named_with_the_way_to_raise_it() {
    let dir = tempfile::tempdir().unwrap();
    let limited = "[host]\nram_bytes = 137438953472\navailable_bytes = 128849018880\nmemlock_limit_bytes = 8388608";
    // A plan whose experts are all resident pins nothing: 8 MiB of memlock is no obstacle.
    let hw = probe_with_host(dir.path(), "plans/hardware/h200.toml", limited);
    let out = plan_cmd(&["--hardware", &hw, "--model", Q8, "--max-context", "4096"]);
    assert_eq!(out.status.code(), Some(0), "{}", err(&out));
    assert!(text(&out).lines().next().unwrap().contains("FEASIBLE"));
    // A plan whose KV streams from host memory needs far more than 8 MiB pinned.
    let out = plan_cmd(&[
        "--hardware",
        &hw,
        "--model",
        Q8,
        "--max-context",
        "131072",
        "--rope-scaling",
        "yarn",
        "--rope-scale",
        "4",
        "--kv-resident",
        "8192",
        "--batch",
        "4",
        "--format",
        "json",
    ]);
    let j = json_of(&out);
    let advice: Vec<&str> = j["suggestions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .filter(|s| s.contains("memlock"))
        .collect();
    assert_eq!(advice.len(), 1, "{}", j["suggestions"]);
    for needle in [
        "ulimit -l",
        "LimitMEMLOCK=",
        "--ulimit memlock=-1:-1",
        "8.0 MiB",
    ] {
        assert!(
            advice[0].contains(needle),
            "`{needle}` missing: {}",
            advice[0]
        );
    }
}

#[test]
fn numbers_are_readable_and_assumed_free_memory_is_flagged() {
    let out = plan_cmd(&[
        "--hardware",
        "plans/hardware/rtx3060.toml",
        "--model",
        Q8,
        "--max-context",
        "131072",
        "--rope-scaling",
        "yarn",
        "--rope-scale",
        "4",
        "--yarn-orig-ctx",
        "32768",
        "--format",
        "json",
    ]);
    let j = json_of(&out);
    let res = j["serve"]["kv_resident"].as_u64().unwrap();
    assert!(res < 131072 && res % 256 == 0, "planned window {res}");
    for s in j["suggestions"].as_array().unwrap() {
        let s = s.as_str().unwrap();
        for flag in ["--kv-resident ", "--max-context "] {
            for (i, _) in s.match_indices(flag) {
                let digits: String = s[i + flag.len()..]
                    .chars()
                    .take_while(char::is_ascii_digit)
                    .collect();
                if let Ok(n) = digits.parse::<u64>() {
                    assert_eq!(n % 256, 0, "{s}");
                }
            }
        }
    }
    assert!(j["notes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|n| n.as_str().unwrap().contains("no free_bytes")));
    let t = text(&plan_cmd(&[
        "--hardware",
        "plans/hardware/rtx3060.toml",
        "--model",
        Q8,
    ]));
    assert!(t.contains(" MiB"), "small regions in MiB:\n{t}");
    assert!(t.contains(" GiB"), "large ones in GiB:\n{t}");
    // A measured probe has free_bytes: no such note.
    let p = json_of(&plan_cmd(&[
        "--hardware",
        "plans/hardware/h200-probed.toml",
        "--model",
        Q8,
        "--format",
        "json",
    ]));
    assert!(
        !p["notes"].to_string().contains("no free_bytes"),
        "{}",
        p["notes"]
    );
}

#[test]
fn model_info_says_which_backend_runs_the_model() {
    let j = json_of(&plan_cmd(&["model-info", Q8, "--format", "json"]));
    assert_eq!(j["runnable"]["cpu"], true);
    assert_eq!(j["runnable"]["cuda"], true);
    // Q4_K_M's Q6_K tensors too: the CUDA kernels read every type the CPU decodes.
    let j = json_of(&plan_cmd(&["model-info", Q4KM, "--format", "json"]));
    assert_eq!(j["runnable"]["cuda"], true, "{}", j["runnable"]);
    let t = text(&plan_cmd(&[
        "model-info",
        "plans/models/qwen3-next-80b-a3b-q4_k_m.toml",
    ]));
    assert!(t.contains("runnable by this build's strata-exec"), "{t}");
    // Qwen3-Next runs on the CUDA engine too (its MTP block included).
    assert!(
        t.lines()
            .any(|l| l.trim_start().starts_with("cuda") && l.contains("yes")),
        "{t}"
    );
}

/// A catalogue of one probe, one model and one preset in a temporary repository layout.
fn tiny_catalogue(dir: &Path) -> PathBuf {
    let cat = dir.join("plans/catalogue");
    for (sub, file) in [
        ("hardware", "h200.toml"),
        ("models", "qwen3-30b-a3b-q8_0.toml"),
        ("serve", "chat-32k.toml"),
    ] {
        let d = dir.join("plans").join(sub);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::copy(root().join("plans").join(sub).join(file), d.join(file)).unwrap();
    }
    std::fs::create_dir_all(&cat).unwrap();
    std::fs::write(
        cat.join("catalogue.toml"),
        "hardware_dir = \"plans/hardware\"\nmodels_dir = \"plans/models\"\nserve_dir = \"plans/serve\"\nhardware = [\"h200\"]\n\n[[model]]\nname = \"qwen3-30b-a3b-q8_0\"\npresets = [\"chat-32k\"]\n",
    )
    .unwrap();
    std::fs::write(
        cat.join("README.md"),
        "# t\n<!-- catalogue table: generated by `strata-plan check plans/catalogue --update` -->\n<!-- end of catalogue table -->\n",
    )
    .unwrap();
    cat
}

#[test]
fn the_catalogue_check_names_drift_and_unexpected_infeasibility() {
    let dir = tempfile::tempdir().unwrap();
    let cat = tiny_catalogue(dir.path());
    let c = cat.to_str().unwrap();
    let out = plan_cmd(&["check", c]);
    assert_eq!(out.status.code(), Some(4), "nothing committed yet");
    assert!(err(&out).contains("h200/qwen3-30b-a3b-q8_0/chat-32k: no committed report"));
    let out = plan_cmd(&["check", c, "--update"]);
    assert_eq!(out.status.code(), Some(0), "{}", err(&out));
    let out = plan_cmd(&["check", c]);
    assert_eq!(out.status.code(), Some(0), "{}", err(&out));
    let table = std::fs::read_to_string(cat.join("README.md")).unwrap();
    assert!(
        table.contains("| h200 | qwen3-30b-a3b-q8_0 | chat-32k | yes | 1 x 32768 |"),
        "{table}"
    );

    // A probe change is drift, named with the entry and the field.
    let hw = dir.path().join("plans/hardware/h200.toml");
    let t = std::fs::read_to_string(&hw).unwrap();
    std::fs::write(
        &hw,
        t.replace("mem_bandwidth_gbps = 4800.0", "mem_bandwidth_gbps = 3350.0"),
    )
    .unwrap();
    let out = plan_cmd(&["check", c]);
    assert_eq!(out.status.code(), Some(4));
    let e = err(&out);
    assert!(e.contains("h200/qwen3-30b-a3b-q8_0/chat-32k: drift"), "{e}");
    assert!(e.contains("decode_tok_s"), "{e}");

    // A probe the model no longer fits: unexpected infeasibility.
    std::fs::write(
        &hw,
        t.replace("vram_bytes = 150754820096", "vram_bytes = 1073741824"),
    )
    .unwrap();
    let out = plan_cmd(&["check", c, "--update"]);
    assert_eq!(out.status.code(), Some(4));
    assert!(
        err(&out).contains("infeasible, and not in expect_infeasible"),
        "{}",
        err(&out)
    );
}
