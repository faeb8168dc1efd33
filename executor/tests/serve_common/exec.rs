//! The real program under test: `strata-exec PLAN --serve` as a child process over the
//! tiny-chat-moe model (random weights, 400-token vocabulary, the tiny-chat tokenizer and
//! its chat template), planned with the planner library for a CPU device.
//! Invariant: a started child is always stopped (Drop kills it if the test did not), its
//! stderr is drained on a thread so it never blocks, and it listens on a free loopback port.

use super::Server;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use strata_plan::solve::{solve, Outcome, PlanRequest};
use strata_schemas::probe::{DeviceProbe, HardwareProbe, HostProbe, Vendor, GIB, MIB};
use strata_schemas::serve::{LayerSplit, ServeSettings};

/// The model folder (weights, config.json, tokenizer.json, tokenizer_config.json).
pub const REAL_MODEL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/data/tiny-chat-moe");

/// One CPU device of 512 MiB on a host with 8 GiB available.
fn cpu_probe() -> HardwareProbe {
    HardwareProbe {
        host: HostProbe {
            ram_bytes: 16 * GIB,
            available_bytes: 8 * GIB,
            memlock_limit_bytes: None,
            disk_read_gbps: None,
        },
        devices: vec![DeviceProbe {
            index: 0,
            name: "cpu".into(),
            vendor: Vendor::Cpu,
            arch: std::env::consts::ARCH.into(),
            vram_bytes: 512 * MIB,
            free_bytes: None,
            runtime_reserve_bytes: Some(16 * MIB),
            mem_bandwidth_gbps: Some(20.0),
            h2d_gbps: Some(20.0),
            pcie_gen: None,
            pcie_width: None,
            peers: None,
            cost: None,
        }],
    }
}

/// Plan `model` for `slots` slots of `ctx` cells with prefill chunks of `ubatch`, and write
/// the plan file into `dir`.
pub fn write_plan(dir: &Path, model: &Path, slots: u32, ctx: u64, ubatch: u32) -> PathBuf {
    let inv = strata_plan::model::load_model(model).unwrap();
    let probe = cpu_probe();
    let settings = ServeSettings {
        max_context: ctx,
        batch: slots,
        ubatch,
        layer_split: LayerSplit::Auto,
        pinned_chunk_mib: 1,
        ..ServeSettings::default()
    };
    let req = PlanRequest {
        inventory: &inv,
        model_source: model.display().to_string(),
        probe: &probe,
        probe_source: "test probe".into(),
        settings: &settings,
        profile: None,
        vision: None,
        mtp_file: None,
    };
    let plan = match solve(&req).unwrap() {
        Outcome::Planned(p) => *p,
        Outcome::Infeasible(i) => panic!("infeasible: {:?}", i.reasons),
    };
    let path = dir.join(format!("tiny-chat-{slots}x{ctx}.plan"));
    strata_schemas::planfile::write_plan(&plan, &path).unwrap();
    path
}

/// A copy of the model folder without its tokenizer files.
pub fn model_without_tokenizer(dir: &Path) -> PathBuf {
    let out = dir.join("no-tokenizer");
    std::fs::create_dir_all(&out).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(Path::new(REAL_MODEL).join(f), out.join(f)).unwrap();
    }
    out
}

/// `strata-exec PLAN --serve` running as a child process.
pub struct ExecServer {
    pub addr: SocketAddr,
    /// The line printed once the model was loaded.
    pub ready_line: String,
    child: Child,
    log: Arc<Mutex<String>>,
}

impl Server for ExecServer {
    fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl ExecServer {
    /// Start `strata-exec PLAN --serve --port 0 -q EXTRA...` and wait until it is ready.
    pub fn start(plan: &Path, extra: &[&str]) -> Self {
        Self::start_with_env(plan, extra, &[])
    }

    /// [`ExecServer::start`] with environment variables set for the child (e.g. `RUST_LOG`).
    pub fn start_with_env(plan: &Path, extra: &[&str], env: &[(&str, &str)]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_strata-exec"))
            .arg(plan)
            .args(["--serve", "--port", "0", "-q"])
            .args(extra)
            .envs(env.iter().copied())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel::<String>();
        let lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let log2 = log.clone();
        std::thread::spawn(move || {
            for l in lines.map_while(Result::ok) {
                if let Ok(mut g) = log2.lock() {
                    g.push_str(&l);
                    g.push('\n');
                }
                let _ = tx.send(l);
            }
        });
        let mut addr = None;
        let t0 = Instant::now();
        let ready_line = loop {
            let left = Duration::from_secs(120).saturating_sub(t0.elapsed());
            let l = match rx.recv_timeout(left) {
                Ok(l) => l,
                Err(_) => {
                    let _ = child.kill();
                    panic!(
                        "strata-exec --serve was not ready in time; stderr:\n{}",
                        log.lock().unwrap()
                    );
                }
            };
            if l.contains("listening on http://") {
                addr = l.split("http://").nth(1).map(|a| a.trim().parse().unwrap());
            }
            if l.contains("ready on http://") {
                break l;
            }
        };
        Self {
            addr: addr.expect("the listening line came before the ready line"),
            ready_line,
            child,
            log,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything the server printed on stderr so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// The server process's resident memory in KiB (Linux /proc).
    pub fn rss_kib(&self) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("VmRSS:"))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|v| v.parse().ok())
            })
            .expect("VmRSS of the server")
    }

    /// Send `sig` (e.g. "-INT", "-TERM") and wait for the exit code; panics after `limit`.
    pub fn stop_with(mut self, sig: &str, limit: Duration) -> i32 {
        let ok = Command::new("kill")
            .args([sig, &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st.code().expect("exited, not killed by a signal");
            }
            if t0.elapsed() > limit {
                let _ = self.child.kill();
                panic!(
                    "strata-exec --serve did not exit within {limit:?} of {sig}; stderr:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ExecServer {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
