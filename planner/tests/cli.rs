//! End-to-end tests of the `strata-plan` command: the two seed reports as regressions, exit
//! codes, the JSON report contract, plan files and `inspect`.

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

const NEXT_IQ3S: &str = "plans/models/qwen3-next-80b-a3b-iq3_s.toml";

/// Seed 000 translated to our flags (see docs/seeds/000_*.txt).
fn seed000_args(hardware: &str) -> Vec<String> {
    [
        "--hardware",
        hardware,
        "--model",
        NEXT_IQ3S,
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
        "--format",
        "json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn run(args: &[String]) -> Output {
    let a: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    plan_cmd(&a)
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a u64: {v}"))
}

/// Checks every plan must pass: regions add up, nothing exceeds a device, the expert cache
/// is the remainder in whole slots.
fn check_accounting(j: &Value) {
    assert_eq!(j["feasible"], true);
    for d in j["devices"].as_array().unwrap() {
        let vram = u(&d["vram_bytes"]);
        let planned = u(&d["planned_bytes"]);
        let sum: u64 = d["regions"].as_object().unwrap().values().map(u).sum();
        assert_eq!(sum, planned, "regions add up to planned_bytes");
        assert!(
            planned <= vram,
            "device {} over-planned: {planned} > {vram}",
            d["index"]
        );
        assert_eq!(u(&d["free_bytes_after"]), vram - planned);
        let slot = u(&d["expert_slot_bytes"]);
        let cache = u(&d["regions"]["expert_cache"]);
        assert_eq!(
            cache,
            u(&d["expert_cache_slots"]) * slot,
            "cache is whole slots"
        );
    }
}

#[test]
fn seed000_plans_four_slots_and_mtp_with_the_cache_sized_after_them() {
    let out = run(&seed000_args("plans/hardware/r9700-x2.toml"));
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j = json_of(&out);
    check_accounting(&j);
    assert_eq!(j["serve"]["batch"], 4, "all four slots planned");
    assert_eq!(j["serve"]["mtp"], true);
    assert_eq!(j["serve"]["vision"], true);
    assert_eq!(j["serve"]["kv_resident"], 32768);
    assert!(
        j["degradations"].as_array().unwrap().is_empty(),
        "{}",
        j["degradations"]
    );
    let devs = j["devices"].as_array().unwrap();
    assert_eq!(devs.len(), 2);
    assert_eq!(devs[1]["holds"]["mtp"], true, "MTP lives with the head");
    assert!(
        u(&devs[1]["regions"]["mtp"]) > 100 << 20,
        "MTP block weights planned"
    );
    for d in devs {
        assert_eq!(d["slots"], 4);
        // Slot state is planned on each card before the cache.
        assert!(u(&d["regions"]["kv_cache"]) > 0);
        assert!(u(&d["regions"]["linear_state"]) > 0);
        assert!(u(&d["regions"]["slot_sessions"]) > 0);
        assert!(u(&d["expert_cache_slots"]) > 0);
    }
    // Every byte of the 4 x 1M-cell KV is placed: VRAM window + pinned host.
    let cell = 13_056u64 + 1_088; // DESIGN.md worked numbers, q8_0, MTP included
    let total_kv = 4 * 1_048_576 * cell;
    let vram_kv: u64 = devs
        .iter()
        .map(|d| u(&d["regions"]["kv_cache"]))
        .sum::<u64>();
    let host_kv = u(&j["host"]["kv_host_bytes"]);
    assert_eq!(host_kv, 4 * (1_048_576 - 32_768) * cell);
    assert!(vram_kv >= 4 * 32_768 * 13_056, "{vram_kv}");
    assert!(host_kv + vram_kv >= total_kv - 4 * 32_768 * 1_088);
    assert!(u(&j["host"]["pinned_chunk_max_bytes"]) <= 256 << 20);
    assert!(u(&j["host"]["ram_required_bytes"]) <= u(&j["host"]["ram_available_bytes"]));
}

#[test]
fn seed000_tighter_cards_shrink_the_cache_not_the_slots() {
    let roomy = json_of(&run(&seed000_args("plans/hardware/r9700-x2.toml")));
    let out = run(&seed000_args("plans/hardware/rx9070xt-x2.toml"));
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tight = json_of(&out);
    check_accounting(&tight);
    assert_eq!(tight["serve"]["batch"], 4);
    assert_eq!(tight["serve"]["kv_resident"], 32768);
    // Slots and the KV window are as asked; with the cache smaller, more experts stay in host
    // RAM next to 53.5 GiB of pinned KV, and the report says that some page from disk, and
    // that the four slots cost expert residency one slot would have.
    let degs = tight["degradations"].as_array().unwrap();
    let whats: Vec<&str> = degs.iter().map(|d| d["what"].as_str().unwrap()).collect();
    assert_eq!(whats, ["experts_in_ram", "expert_residency"], "{degs:?}");
    let slots = |j: &Value| -> u64 {
        j["devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| u(&d["expert_cache_slots"]))
            .sum()
    };
    assert!(
        slots(&tight) < slots(&roomy),
        "cache shrinks: {} vs {}",
        slots(&tight),
        slots(&roomy)
    );
    assert!(tight["predicted"]["expert_hit_rate"].as_f64().unwrap() < 1.0);
}

#[test]
fn seed004_three_3060s_honour_the_split_with_bounded_pinned_chunks() {
    let args: Vec<String> = [
        "--hardware",
        "plans/hardware/rtx3060-x3.toml",
        "--model",
        NEXT_IQ3S,
        "--layer-split",
        "16,32",
        "--batch",
        "2",
        "--max-context",
        "235520",
        "--kv",
        "q8_0",
        "--kv-resident",
        "32768",
        "--mtp",
        "--spec",
        "4",
        "--vision",
        "--vram-reserve-mib",
        "700",
        "--format",
        "json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let out = run(&args);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j = json_of(&out);
    check_accounting(&j);
    assert_eq!(j["serve"]["batch"], 2);
    let layers: Vec<(u64, u64)> = j["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (u(&d["layers"][0]), u(&d["layers"][1])))
        .collect();
    assert_eq!(layers, vec![(0, 16), (16, 32), (32, 48)]);
    // The catalogue's 3060 probe lists no peers: hand-offs go through pinned host memory.
    let handoffs: Vec<&str> = j["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["handoff_in"].as_str().unwrap())
        .collect();
    assert_eq!(handoffs, ["none", "host", "host"]);
    let h = &j["host"];
    assert!(
        u(&h["pinned_chunk_max_bytes"]) <= 256 << 20,
        "bounded pinned chunks"
    );
    assert!(u(&h["pinned_chunks"]) > 1);
    // The host verdict adds what must stay in RAM: pinned KV spill, staging and host expert
    // tiers plus the non-resident experts of devices without a tier (mapped from the file).
    assert_eq!(
        u(&h["ram_required_bytes"]),
        u(&h["pinned_bytes"]) + u(&h["experts_host_bytes"])
    );
    assert!(
        u(&h["experts_pinned_bytes"]) + u(&h["experts_host_bytes"]) > 0,
        "12 GB cards cannot hold every expert"
    );
    assert_eq!(h["experts_page_from_disk"], false);
    assert_eq!(
        u(&h["kv_host_bytes"]),
        2 * (235_520 - 32_768) * (13_056 + 1_088)
    );
}

#[test]
fn plan_file_round_trips_through_inspect_and_is_deterministic() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.plan");
    let b = dir.path().join("b.plan");
    for p in [&a, &b] {
        let mut args = seed000_args("plans/hardware/r9700-x2.toml");
        args.push("-o".into());
        args.push(p.display().to_string());
        let out = run(&args);
        assert_eq!(out.status.code(), Some(0));
    }
    let bytes_a = std::fs::read(&a).unwrap();
    assert_eq!(bytes_a, std::fs::read(&b).unwrap(), "byte-identical plans");
    let direct = json_of(&run(&seed000_args("plans/hardware/r9700-x2.toml")));
    let out = plan_cmd(&["inspect", a.to_str().unwrap(), "--format", "json"]);
    assert_eq!(out.status.code(), Some(0));
    let mut inspected = json_of(&out);
    // inspect adds each device's working buffers to the report.
    let scratch = inspected
        .as_object_mut()
        .and_then(|o| o.remove("scratch"))
        .expect("inspect lists the scratch buffers");
    assert_eq!(inspected, direct, "inspect prints the same report");
    assert_eq!(scratch.as_array().map(|a| a.len()), Some(2), "{scratch}");
    let text = plan_cmd(&["inspect", a.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("FEASIBLE"));
    assert!(text.contains("device 0 scratch:"), "{text}");

    // A corrupted or truncated plan is exit 1 with a message, never a panic.
    let mut bad = bytes_a.clone();
    let mid = bad.len() / 2;
    bad[mid] ^= 0x40;
    let c = dir.path().join("corrupt.plan");
    std::fs::write(&c, &bad).unwrap();
    let out = plan_cmd(&["inspect", c.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("corrupt.plan"));
    std::fs::write(&c, &bytes_a[..100]).unwrap();
    let out = plan_cmd(&["inspect", c.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("truncated"));
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.display().to_string()
}

#[test]
fn bad_input_exits_1_naming_the_flag_or_key() {
    let dir = tempfile::tempdir().unwrap();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec!["--max-context".into(), "1048576".into()],
            "--rope-scaling yarn",
        ),
        (vec!["--batch".into(), "0".into()], "--batch"),
        (vec!["--gpu".into(), "7".into()], "--gpu 7"),
        (vec!["--kv".into(), "q4".into()], "--kv"),
        (
            vec!["--layer-split".into(), "30,10".into()],
            "--layer-split",
        ),
        (vec!["--layer-split".into(), "16".into()], "needs 2"),
        (vec!["--kv-resident".into(), "0".into()], "--kv-resident"),
        (
            vec!["--expert-cache".into(), "lots".into()],
            "--expert-cache",
        ),
        (
            vec![
                "--max-context".into(),
                "1048576".into(),
                "--rope-scaling".into(),
                "yarn".into(),
                "--rope-scale".into(),
                "2".into(),
            ],
            "--rope-scale",
        ),
    ];
    for (extra, needle) in cases {
        let mut args: Vec<String> = vec![
            "--hardware".into(),
            "plans/hardware/rtx3060-x3.toml".into(),
            "--model".into(),
            NEXT_IQ3S.into(),
        ];
        args.extend(extra.clone());
        let out = run(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{extra:?}: {err}");
        assert!(err.contains(needle), "{extra:?}: `{needle}` not in: {err}");
    }
    // Unknown probe key, zero size.
    let probe = std::fs::read_to_string(root().join("plans/hardware/rtx3060.toml")).unwrap();
    let typo = write(
        dir.path(),
        "typo.toml",
        &probe.replace("pcie_width", "pcie_widht"),
    );
    let out = plan_cmd(&["--hardware", &typo, "--model", NEXT_IQ3S]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("pcie_widht"));
    let zero = write(
        dir.path(),
        "zero.toml",
        &probe.replace("vram_bytes = 12884901888", "vram_bytes = 0"),
    );
    let out = plan_cmd(&["--hardware", &zero, "--model", NEXT_IQ3S]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("vram_bytes"));
    // Unknown serve.toml key.
    let serve = write(dir.path(), "serve.toml", "max-context = 8192\nbatchh = 2\n");
    let out = plan_cmd(&[
        "--hardware",
        "plans/hardware/rtx3060.toml",
        "--model",
        NEXT_IQ3S,
        "--serve",
        &serve,
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("batchh"));
    // Missing model file.
    let out = plan_cmd(&[
        "--hardware",
        "plans/hardware/rtx3060.toml",
        "--model",
        "nope.toml",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("nope.toml"));
}

#[test]
fn serve_toml_keys_mirror_flags_and_flags_win() {
    let dir = tempfile::tempdir().unwrap();
    let serve = write(
        dir.path(),
        "serve.toml",
        "max-context = 65536\nbatch = 3\nkv = \"q8_0\"\nkv-resident = 16384\n",
    );
    let out = plan_cmd(&[
        "--hardware",
        "plans/hardware/rtx4090.toml",
        "--model",
        NEXT_IQ3S,
        "--serve",
        &serve,
        "--batch",
        "2",
        "--format",
        "json",
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j = json_of(&out);
    assert_eq!(j["serve"]["max_context"], 65536);
    assert_eq!(j["serve"]["batch"], 2);
    assert_eq!(j["serve"]["kv"], "q8_0");
    assert_eq!(j["serve"]["kv_resident"], 16384);
}

#[test]
fn infeasible_exits_2_with_the_shortfall_per_device_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let probe = write(
        dir.path(),
        "small.toml",
        "[host]\nram_bytes = 17179869184\navailable_bytes = 16000000000\n\n[[device]]\nindex = 0\nname = \"tiny\"\nvendor = \"nvidia\"\narch = \"sm_86\"\nvram_bytes = 2147483648\n",
    );
    let plan = dir.path().join("x.plan");
    let out = plan_cmd(&[
        "--hardware",
        &probe,
        "--model",
        NEXT_IQ3S,
        "--mtp",
        "--vision",
        "-o",
        plan.to_str().unwrap(),
        "--format",
        "json",
    ]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!plan.exists(), "no plan written when infeasible");
    let j = json_of(&out);
    assert_eq!(j["feasible"], false);
    let d = &j["devices"][0];
    assert!(u(&d["shortfall_bytes"]) > 0);
    assert_eq!(
        u(&d["shortfall_bytes"]),
        u(&d["planned_bytes"]) - u(&d["vram_bytes"]),
        "shortfall is needed minus vram"
    );
    assert!(!j["suggestions"].as_array().unwrap().is_empty());
    let text = plan_cmd(&[
        "--hardware",
        &probe,
        "--model",
        NEXT_IQ3S,
        "--mtp",
        "--vision",
    ]);
    assert_eq!(text.status.code(), Some(2));
    let t = String::from_utf8_lossy(&text.stdout);
    assert!(t.contains("SHORT BY"), "{t}");
    assert!(t.contains("drop --vision"), "{t}");
}

#[test]
fn degraded_request_is_listed_and_strict_exits_3() {
    // 64 slots of 262144 cells cannot have their KV pinned in 56 GiB of RAM with any VRAM
    // window that fits three 12 GB cards: slots must drop, and the report must say so.
    let args = [
        "--hardware",
        "plans/hardware/rtx3060-x3.toml",
        "--model",
        NEXT_IQ3S,
        "--max-context",
        "262144",
        "--kv",
        "q8_0",
        "--batch",
        "64",
        "--format",
        "json",
    ];
    let out = plan_cmd(&args);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j = json_of(&out);
    check_accounting(&j);
    let planned = u(&j["serve"]["batch"]);
    assert!((1..64).contains(&planned), "{planned}");
    let degs = j["degradations"].as_array().unwrap();
    let batch = degs
        .iter()
        .find(|d| d["what"] == "batch")
        .expect("batch degradation listed");
    assert_eq!(batch["requested"], "64 slots");
    assert!(!batch["reason"].as_str().unwrap().is_empty());
    let sugg: Vec<&str> = j["suggestions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    assert!(sugg.iter().any(|s| s.contains("--max-context")), "{sugg:?}");
    assert!(sugg.iter().any(|s| s.contains("--batch")), "{sugg:?}");

    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("s.plan");
    let mut strict: Vec<&str> = args.to_vec();
    strict.extend(["--strict", "-o", plan.to_str().unwrap()]);
    let out = plan_cmd(&strict);
    assert_eq!(out.status.code(), Some(3));
    assert!(!plan.exists(), "--strict writes no degraded plan");
    assert!(String::from_utf8_lossy(&out.stderr).contains("batch"));
}

#[test]
fn mixed_cards_get_a_sensible_auto_split() {
    let out = plan_cmd(&[
        "--hardware",
        "plans/hardware/mixed-3060-4090.toml",
        "--model",
        NEXT_IQ3S,
        "--max-context",
        "32768",
        "--format",
        "json",
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j = json_of(&out);
    check_accounting(&j);
    let d = j["devices"].as_array().unwrap();
    let n0 = u(&d[0]["layers"][1]) - u(&d[0]["layers"][0]);
    let n1 = u(&d[1]["layers"][1]) - u(&d[1]["layers"][0]);
    assert_eq!(n0 + n1, 48);
    assert!(
        n1 > n0,
        "the 24 GB, 1 TB/s card takes more layers: {n0} vs {n1}"
    );
    assert!(n0 >= 4, "the 12 GB card still carries its share: {n0}");
}

#[test]
fn help_teaches_the_flags_and_exit_codes() {
    let out = plan_cmd(&["--help"]);
    assert_eq!(out.status.code(), Some(0));
    let h = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "--kv-resident",
        "--layer-split",
        "--expert-cache",
        "Exit codes",
        "inspect",
        "Reservation order",
    ] {
        assert!(h.contains(needle), "--help lacks {needle}");
    }
}

#[test]
fn expert_cache_policies_cap_and_off() {
    let base = [
        "--hardware",
        "plans/hardware/rtx3060-x3.toml",
        "--model",
        NEXT_IQ3S,
        "--max-context",
        "8192",
        "--format",
        "json",
    ];
    let slots = |extra: &[&str]| -> (u64, Value) {
        let mut a = base.to_vec();
        a.extend_from_slice(extra);
        let out = plan_cmd(&a);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let j = json_of(&out);
        check_accounting(&j);
        let s = j["devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| u(&d["expert_cache_slots"]))
            .sum();
        (s, j)
    };
    let (auto, _) = slots(&[]);
    let (capped, _) = slots(&["--expert-cache", "1000"]);
    let (off, j) = slots(&["--expert-cache", "off"]);
    assert!(auto > 10_000, "{auto}");
    assert_eq!(capped, 1000);
    // Off keeps only the minimum working set: 2 x top-k (10) per device.
    assert_eq!(off, 3 * 20);
    assert!(j["predicted"]["expert_hit_rate"].as_f64().unwrap() < 0.01);
    let (_, j) = slots(&["--expert-cache", "999999"]);
    let d = j["degradations"].as_array().unwrap();
    assert!(d.iter().any(|x| x["what"] == "expert_cache"), "{d:?}");
}

#[test]
fn gpu_order_is_the_pipeline_order() {
    let out = plan_cmd(&[
        "--hardware",
        "plans/hardware/mixed-3060-4090.toml",
        "--model",
        NEXT_IQ3S,
        "--gpu",
        "1,0",
        "--format",
        "json",
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j = json_of(&out);
    let d = j["devices"].as_array().unwrap();
    assert_eq!(d[0]["index"], 1);
    assert_eq!(d[0]["holds"]["embedding"], true);
    assert_eq!(d[1]["index"], 0);
    assert_eq!(d[1]["holds"]["head"], true);
    assert_eq!(u(&d[0]["layers"][0]), 0);
}

#[test]
fn requests_the_model_cannot_serve_are_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    // MTP on a model without an MTP block.
    let out = plan_cmd(&[
        "--hardware",
        "plans/hardware/h100.toml",
        "--model",
        "plans/models/qwen3-30b-a3b-q8_0.toml",
        "--mtp",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("MTP"));
    // Vision without a tower.
    let out = plan_cmd(&[
        "--hardware",
        "plans/hardware/h100.toml",
        "--model",
        "plans/models/qwen3-30b-a3b-q8_0.toml",
        "--vision",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--vision"));
    // A profile with the wrong shape.
    let prof = write(
        dir.path(),
        "p.txt",
        "# strata expert profile v1\nlayers = 2\nexperts = 3\n0: 1 2 3\n1: 4 5 6\n",
    );
    let out = plan_cmd(&[
        "--hardware",
        "plans/hardware/h100.toml",
        "--model",
        NEXT_IQ3S,
        "--expert-profile",
        &prof,
    ]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("p.txt"));
}

#[test]
fn a_profile_raises_the_predicted_hit_rate_over_uniform() {
    let dir = tempfile::tempdir().unwrap();
    // Skewed routing: expert e of every block is chosen ~1/(e+1) as often.
    let mut text = String::from("# strata expert profile v1\nlayers = 49\nexperts = 512\n");
    for l in 0..49 {
        let row: Vec<String> = (0..512u64)
            .map(|e| (100_000 / (e + 1)).to_string())
            .collect();
        text.push_str(&format!("{l}: {}\n", row.join(" ")));
    }
    let prof = write(dir.path(), "skew.txt", &text);
    let args = [
        "--hardware",
        "plans/hardware/rtx4090.toml",
        "--model",
        NEXT_IQ3S,
        "--format",
        "json",
    ];
    let uniform = json_of(&plan_cmd(&args));
    let mut a = args.to_vec();
    a.extend(["--expert-profile", prof.as_str()]);
    let out = plan_cmd(&a);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let skew = json_of(&out);
    let hu = uniform["predicted"]["expert_hit_rate"].as_f64().unwrap();
    let hs = skew["predicted"]["expert_hit_rate"].as_f64().unwrap();
    assert!(hs > hu + 0.05, "profile {hs} vs uniform {hu}");
    assert!(
        skew["predicted"]["decode_tok_s"].as_f64().unwrap()
            > uniform["predicted"]["decode_tok_s"].as_f64().unwrap()
    );
}

/// A plan of a model this build runs lists, per device, the named working buffers the
/// executor binds (the GPU backend's set, sized for the planned pass); `inspect` shows them.
#[test]
fn inspect_lists_the_executor_working_set() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("q30.plan");
    let out = plan_cmd(&[
        "--hardware",
        "plans/hardware/h200.toml",
        "--model",
        "plans/models/qwen3-30b-a3b-q8_0.toml",
        "--max-context",
        "4096",
        "--batch",
        "2",
        "-o",
        p.to_str().unwrap(),
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = json_of(&plan_cmd(&[
        "inspect",
        p.to_str().unwrap(),
        "--format",
        "json",
    ]));
    let dev = &v["scratch"][0];
    assert_eq!(dev["pass"]["tokens"], 512, "{dev}");
    assert_eq!(dev["pass"]["slots"], 2);
    assert_eq!(dev["pass"]["gemm"], true);
    let names: Vec<&str> = dev["buffers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["name"].as_str().unwrap())
        .collect();
    for want in [
        "inputs", "x", "xn", "q", "att", "logits", "h", "tables", "xh", "sorted",
    ] {
        assert!(names.contains(&want), "{want} missing from {names:?}");
    }
    // Every buffer lies inside the device's scratch region, none overlapping.
    let region = u(&v["devices"][0]["regions"]["scratch"]);
    let mut spans: Vec<(u64, u64)> = dev["buffers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| (u(&b["offset"]), u(&b["offset"]) + u(&b["bytes"])))
        .collect();
    spans.sort();
    assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "{spans:?}");
    assert!(spans.last().unwrap().1 <= region);
    let text =
        String::from_utf8_lossy(&plan_cmd(&["inspect", p.to_str().unwrap()]).stdout).to_string();
    assert!(text.contains("passes of 512 tokens"), "{text}");
}
