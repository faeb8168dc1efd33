//! `strata-gguf`: writes GGUF model files for tests and benchmarks — random weights at any
//! shape in llama.cpp's layout (`random`), a converted Hugging Face folder (`convert`), or a
//! requantized copy of any GGUF Strata reads (`quantize`), or a model split into its main
//! file and llama.cpp's MTP-only file (`split-mtp`).
//! Invariant: every tensor table comes from `strata_schemas::arch` (directly or through a
//! descriptor), so what this writes is what the planner synthesizes; errors name the flag or
//! file and exit 1 (clap usage errors exit 2).

use clap::{Args, Parser, Subcommand};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;
use strata_schemas::arch::{self, QuantRecipe, PRESETS};
use strata_schemas::descriptor::load_descriptor;
use strata_schemas::ggml::GgmlType;
use strata_schemas::gguf::convert::convert_hf_folder;
use strata_schemas::gguf::metadata::file_type;
use strata_schemas::gguf::quantize::{quantize_gguf, QuantTarget, QuantizeOptions};
use strata_schemas::gguf::random::{
    write_random_model, write_random_tensors, RandomOptions, Routing,
};
use strata_schemas::gguf::split_mtp::split_mtp;
use strata_schemas::gguf::write::{ProgressFn, WriteSummary};
use strata_schemas::inventory::HParams;

#[derive(Parser)]
#[command(
    name = "strata-gguf",
    version,
    about = "Write GGUF model files: random weights at any shape, a converted Hugging Face folder, or a requantized GGUF"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
// Parsed once; boxing the larger variant would buy nothing.
#[allow(clippy::large_enum_variant)]
enum Cmd {
    /// Random-weight model in llama.cpp's layout (deterministic from --seed).
    ///
    /// Hyperparameters start from the architecture's flagship model (qwen3moe: Qwen3-30B-A3B,
    /// qwen3next: Qwen3-Next-80B-A3B) and each flag overrides one; or take them, and the quant
    /// mix, from a model descriptor (--descriptor plans/models/qwen3-30b-a3b-q8_0.toml).
    /// Every preset's per-tensor types are llama-quantize's for that mix. Types with a
    /// quantizer here (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL,
    /// MXFP4) are quantized from the random draws; the others (Q2_K, Q3_K, the i-quants) are
    /// valid random blocks of the same scale. Every block is real: no preset needs
    /// --zero-unsupported.
    Random(RandomArgs),
    /// Convert a Hugging Face Qwen3-MoE or Qwen3-Next folder (F32/F16/BF16 safetensors) to
    /// the GGUF llama.cpp's converter writes.
    ///
    /// Qwen3-Next: norms stored +1, A_log as ssm_a = -exp(A_log), in_proj_qkvz regrouped into
    /// attn_qkv + attn_gate, the MTP block (mtp.*) as block n_layer with its nextn.* tensors
    /// (docs/QWEN3NEXT.md). A folder tensor with no place in the GGUF is an error.
    Convert(ConvertArgs),
    /// Requantize a GGUF: every matrix llama.cpp would quantize (2-D+ weights but norms, the
    /// router and ssm_conv1d) to --type (like llama-quantize --pure) or a --preset's mix.
    ///
    /// Reads any GGUF Strata reads (any type the CPU reference decodes, split files too),
    /// dequantizes each such tensor and quantizes it again; other tensors and tensors already
    /// of their target type are copied unchanged. Metadata is kept; the output is written to
    /// OUT.partial and renamed when complete. Example:
    /// `strata-gguf quantize Qwen3-30B-A3B-IQ3_S.gguf q8.gguf --type Q8_0`
    Quantize(QuantizeArgs),
    /// Split a GGUF that holds its MTP block into the two files llama.cpp's converter writes
    /// for the same checkpoint: the main model as `convert_hf_to_gguf.py --no-mtp` writes it
    /// (block_count = n_layer, no nextn_predict_layers, no blk.{n_layer}.*) and the MTP-only
    /// file as `--mtp` writes it (all metadata, the MTP block's tensors plus token_embd,
    /// output_norm and output). Bytes are copied unchanged. Example:
    /// `strata-gguf split-mtp next.gguf --main-out next-main.gguf --mtp-out mtp-next.gguf`,
    /// then `strata-plan --model next-main.gguf --mtp-model mtp-next.gguf --spec 3 ...`
    SplitMtp(SplitMtpArgs),
}

#[derive(Args)]
struct SplitMtpArgs {
    /// Input GGUF with its MTP block (nextn_predict_layers > 0).
    input: PathBuf,
    /// The main model without the MTP block.
    #[arg(long, value_name = "MAIN.gguf")]
    main_out: PathBuf,
    /// The MTP-only file.
    #[arg(long, value_name = "MTP.gguf")]
    mtp_out: PathBuf,
}

#[derive(Args)]
struct RandomArgs {
    /// Architecture: qwen3moe or qwen3next (taken from the descriptor when one is given).
    #[arg(long)]
    arch: Option<String>,
    /// Quant preset, llama-quantize's per-tensor mix: Q4_K_M, Q5_K_M, Q3_K_M, IQ3_M, IQ3_S,
    /// IQ4_XS, Q4_0, Q8_0, Q4_K (pure), UD-Q4_K_XL (unsloth-style: dense work Q8_0, experts
    /// Q4_K/Q5_K), BF16, F16, F32 (default: the descriptor's mix, else Q8_0).
    #[arg(long)]
    preset: Option<String>,
    /// Output file.
    #[arg(long)]
    out: PathBuf,
    /// Model descriptor TOML (hyperparameters and quant mix); excludes the shape flags.
    #[arg(long, conflicts_with_all = ["layers", "embd", "heads", "kv_heads", "head_dim", "experts", "experts_used", "ff_exp", "ff_shexp", "vocab", "ctx", "mtp", "full_attn_interval", "ssm_state", "ssm_groups", "ssm_heads", "ssm_inner", "ssm_conv"])]
    descriptor: Option<PathBuf>,
    /// Seed of the weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Generator threads (0: all cores but one, which writes).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// general.name (default: from the descriptor or "random <arch>").
    #[arg(long)]
    name: Option<String>,
    /// Tokenizer keys (`tokenizer.ggml.*`) from DIR/tokenizer.json, a Hugging Face byte-level
    /// BPE folder (e.g. tests/data/tiny-chat-moe), padded to the vocabulary with unused
    /// tokens: what llama.cpp's tools need to load the file (llama-bench, llama-cli).
    #[arg(long, value_name = "DIR", conflicts_with = "descriptor")]
    vocab_from: Option<PathBuf>,
    /// Write all-zero blocks for types the CPU reference cannot decode at all (TQ1_0, TQ2_0,
    /// Q8_1..., reachable only through a descriptor's overrides) instead of failing.
    #[arg(long)]
    zero_unsupported: bool,
    /// Draw every quantized tensor (all but F32/F16/BF16) as valid random blocks in the
    /// quantized domain instead of quantizing random values: a 30B Q4_K_M or IQ3_S file is
    /// then written as fast as a Q8_0 one. Same tensors, types and scales; for speed
    /// benchmarks, where the values do not matter.
    #[arg(long)]
    random_blocks: bool,
    /// Main blocks (block_count without MTP blocks).
    #[arg(long)]
    layers: Option<u32>,
    /// embedding_length.
    #[arg(long)]
    embd: Option<u64>,
    /// attention.head_count.
    #[arg(long)]
    heads: Option<u64>,
    /// attention.head_count_kv.
    #[arg(long)]
    kv_heads: Option<u64>,
    /// attention.key_length = value_length.
    #[arg(long)]
    head_dim: Option<u64>,
    /// expert_count.
    #[arg(long)]
    experts: Option<u64>,
    /// expert_used_count.
    #[arg(long)]
    experts_used: Option<u64>,
    /// expert_feed_forward_length.
    #[arg(long)]
    ff_exp: Option<u64>,
    /// expert_shared_feed_forward_length (qwen3next).
    #[arg(long)]
    ff_shexp: Option<u64>,
    /// Vocabulary size (rows of token_embd).
    #[arg(long)]
    vocab: Option<u64>,
    /// context_length.
    #[arg(long)]
    ctx: Option<u64>,
    /// MTP blocks (qwen3next nextn_predict_layers).
    #[arg(long)]
    mtp: Option<u32>,
    /// full_attention_interval (qwen3next).
    #[arg(long)]
    full_attn_interval: Option<u32>,
    /// ssm.state_size (qwen3next key head dim).
    #[arg(long)]
    ssm_state: Option<u64>,
    /// ssm.group_count (qwen3next key heads).
    #[arg(long)]
    ssm_groups: Option<u64>,
    /// ssm.time_step_rank (qwen3next value heads).
    #[arg(long)]
    ssm_heads: Option<u64>,
    /// ssm.inner_size (qwen3next value heads x value head dim).
    #[arg(long)]
    ssm_inner: Option<u64>,
    /// ssm.conv_kernel (qwen3next).
    #[arg(long)]
    ssm_conv: Option<u64>,
    /// How the router picks experts: `uniform` (every tensor ~N(0, 0.02): nearly the same
    /// experts for every token) or `skewed` (Zipf-like expert popularity per layer, picks
    /// varying from token to token, as trained models route; see --router-skew).
    #[arg(long, default_value = "uniform", value_parser = ["uniform", "skewed"])]
    routing: String,
    /// With --routing skewed: the Zipf-like exponent of expert popularity (the router bias of
    /// the expert of rank r is -SKEW x ln(1 + r) logit spreads); 0 = no popularity skew.
    #[arg(long, value_name = "SKEW")]
    router_skew: Option<f32>,
}

#[derive(Args)]
struct ConvertArgs {
    /// Hugging Face model folder (config.json + model.safetensors or an index and shards).
    dir: PathBuf,
    /// Matrix type: f32, f16, bf16, q8_0, q4_k (norms, routers and ssm_conv1d stay F32).
    #[arg(long = "type", default_value = "q8_0")]
    ty: String,
    /// Output file.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
struct QuantizeArgs {
    /// Input GGUF (the first part of a split model).
    input: PathBuf,
    /// Output GGUF.
    output: PathBuf,
    /// Target type for every quantizable tensor: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
    /// Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, MXFP4.
    #[arg(
        long = "type",
        conflicts_with = "preset",
        required_unless_present = "preset"
    )]
    ty: Option<String>,
    /// Target mix instead of one type (presets whose types all have a quantizer: Q4_K_M,
    /// Q5_K_M, Q4_0, Q8_0, Q4_K, UD-Q4_K_XL, BF16, F16, F32).
    #[arg(long)]
    preset: Option<String>,
    /// Worker threads (0: all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
}

use strata_schemas::known::{qwen3_30b_a3b, qwen3_next_80b_a3b};

/// The flagship's hyperparameters with the shape flags applied.
fn hparams_from_flags(arch: &str, a: &RandomArgs) -> Result<HParams, String> {
    let mut hp = match arch {
        "qwen3moe" => qwen3_30b_a3b(),
        "qwen3next" => qwen3_next_80b_a3b(),
        other => {
            return Err(format!(
                "--arch {other}: not supported (supported: {})",
                arch::SUPPORTED.join(", ")
            ))
        }
    };
    let set = |v: &mut u64, f: Option<u64>| {
        if let Some(x) = f {
            *v = x;
        }
    };
    if let Some(l) = a.layers {
        hp.n_layer = l;
    }
    set(&mut hp.n_embd, a.embd);
    set(&mut hp.n_head, a.heads);
    set(&mut hp.n_head_kv, a.kv_heads);
    set(&mut hp.head_dim_k, a.head_dim);
    set(&mut hp.head_dim_v, a.head_dim);
    set(&mut hp.n_expert, a.experts);
    set(&mut hp.n_expert_used, a.experts_used);
    set(&mut hp.n_ff_exp, a.ff_exp);
    set(&mut hp.n_vocab, a.vocab);
    set(&mut hp.n_ctx_train, a.ctx);
    let ssm_flags = [
        a.ssm_state,
        a.ssm_groups,
        a.ssm_heads,
        a.ssm_inner,
        a.ssm_conv,
    ];
    match hp.ssm.as_mut() {
        Some(s) => {
            set(&mut s.state_size, a.ssm_state);
            set(&mut s.group_count, a.ssm_groups);
            set(&mut s.time_step_rank, a.ssm_heads);
            set(&mut s.inner_size, a.ssm_inner);
            set(&mut s.conv_kernel, a.ssm_conv);
            set(&mut hp.n_ff_shexp, a.ff_shexp);
            if let Some(m) = a.mtp {
                hp.nextn_predict_layers = m;
            }
            if let Some(i) = a.full_attn_interval {
                hp.full_attention_interval = Some(i);
            }
            if a.head_dim.is_some() && hp.rope_dim.is_some() {
                // Keep Qwen3-Next's partial rotary fraction: a quarter of the head.
                hp.rope_dim = Some((hp.head_dim_k / 4).max(2) & !1);
            }
        }
        None => {
            if ssm_flags.iter().any(Option::is_some)
                || a.ff_shexp.is_some()
                || a.mtp.is_some()
                || a.full_attn_interval.is_some()
            {
                return Err(format!(
                    "--arch {arch} has no linear attention, shared expert or MTP block; drop the --ssm-*, --ff-shexp, --mtp and --full-attn-interval flags"
                ));
            }
        }
    }
    Ok(hp)
}

fn recipe(preset: &str) -> Result<QuantRecipe, String> {
    QuantRecipe::preset(preset)
        .ok_or_else(|| format!("--preset {preset}: unknown (known: {})", PRESETS.join(", ")))
}

/// Prints `written / total MB (MB/s)` to stderr, overwriting the line.
fn progress(label: String) -> ProgressFn {
    let start = Instant::now();
    Box::new(move |done, total| {
        let mb = |b: u64| b as f64 / 1e6;
        let secs = start.elapsed().as_secs_f64().max(1e-9);
        let mut e = std::io::stderr().lock();
        let _ = write!(
            e,
            "\r{label}: {:.0} / {:.0} MB ({:.1}%), {:.0} MB/s   ",
            mb(done),
            mb(total),
            100.0 * done as f64 / total.max(1) as f64,
            mb(done) / secs
        );
        if done >= total {
            let _ = writeln!(e);
        }
    })
}

fn report(s: &WriteSummary) {
    eprintln!(
        "wrote {} ({} tensors, {} bytes, data at byte {}) in {:.1} s, {:.0} MB/s",
        s.path.display(),
        s.n_tensors,
        s.file_bytes,
        s.data_offset,
        s.seconds,
        s.file_bytes as f64 / 1e6 / s.seconds.max(1e-9)
    );
}

/// The --routing and --router-skew flags.
fn routing(a: &RandomArgs) -> Result<Routing, String> {
    match (a.routing.as_str(), a.router_skew) {
        ("uniform", None) => Ok(Routing::Uniform),
        ("uniform", Some(_)) => {
            Err("--router-skew needs --routing skewed (uniform routing has no skew)".into())
        }
        (_, skew) => {
            let skew = skew.unwrap_or(DEFAULT_ROUTER_SKEW);
            if !(0.0..=8.0).contains(&skew) {
                return Err(format!("--router-skew {skew}: must be in 0..=8"));
            }
            Ok(Routing::Skewed { skew })
        }
    }
}

/// --router-skew when --routing skewed is given alone.
const DEFAULT_ROUTER_SKEW: f32 = 1.0;

fn run_random(a: RandomArgs) -> Result<WriteSummary, String> {
    let label = a.out.display().to_string();
    let mut opts = RandomOptions {
        threads: a.threads,
        zero_fill_unsupported: a.zero_unsupported,
        random_blocks: a.random_blocks,
        progress: Some(progress(label)),
        routing: routing(&a)?,
        ..Default::default()
    };
    if let Some(d) = &a.descriptor {
        let inv = load_descriptor(d).map_err(|e| e.to_string())?;
        if let Some(arch) = &a.arch {
            if *arch != inv.arch {
                return Err(format!(
                    "--arch {arch} disagrees with {} (arch = \"{}\"); drop --arch",
                    d.display(),
                    inv.arch
                ));
            }
        }
        opts.name = a.name.clone().unwrap_or_else(|| inv.name.clone());
        return match &a.preset {
            Some(p) => {
                write_random_model(&a.out, &inv.arch, &inv.hparams, &recipe(p)?, a.seed, opts)
            }
            None => {
                let ft = file_type("", &inv.tensors);
                write_random_tensors(
                    &a.out,
                    &inv.arch,
                    &inv.hparams,
                    &inv.tensors,
                    ft,
                    a.seed,
                    opts,
                )
            }
        }
        .map_err(|e| e.to_string());
    }
    let arch = a
        .arch
        .clone()
        .ok_or("--arch is required without --descriptor (qwen3moe or qwen3next)")?;
    let hp = hparams_from_flags(&arch, &a)?;
    let r = recipe(a.preset.as_deref().unwrap_or("Q8_0"))?;
    opts.name = a.name.clone().unwrap_or_else(|| format!("random {arch}"));
    if let Some(dir) = &a.vocab_from {
        opts.vocab = Some(
            strata_schemas::gguf::convert::vocab_from_folder(dir, hp.n_vocab)
                .map_err(|e| format!("--vocab-from {}: {e}", dir.display()))?
                .ok_or_else(|| {
                    format!(
                        "--vocab-from {}: no tokenizer.json there (give a Hugging Face model folder)",
                        dir.display()
                    )
                })?,
        );
    }
    write_random_model(&a.out, &arch, &hp, &r, a.seed, opts).map_err(|e| e.to_string())
}

fn run_convert(a: ConvertArgs) -> Result<WriteSummary, String> {
    let ty = GgmlType::from_name(&a.ty.to_ascii_uppercase())
        .filter(|t| {
            matches!(
                t,
                GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q8_0 | GgmlType::Q4K
            )
        })
        .ok_or_else(|| format!("--type {}: use f32, f16, bf16, q8_0 or q4_k", a.ty))?;
    let label = a.out.display().to_string();
    convert_hf_folder(&a.dir, &a.out, ty, Some(progress(label))).map_err(|e| e.to_string())
}

fn run_quantize(a: QuantizeArgs) -> Result<WriteSummary, String> {
    let target = match (&a.ty, &a.preset) {
        (Some(t), _) => {
            let ty = GgmlType::from_name(t)
                .filter(|t| strata_schemas::quant::can_quantize(*t))
                .ok_or_else(|| {
                    let names: Vec<_> = strata_schemas::quant::QUANTIZABLE
                        .iter()
                        .map(|t| t.name())
                        .collect();
                    format!(
                        "--type {t}: no quantizer here; use one of {}",
                        names.join(", ")
                    )
                })?;
            QuantTarget::Type(ty)
        }
        (None, Some(p)) => QuantTarget::Preset(recipe(p)?),
        (None, None) => return Err("give --type T or --preset P".into()),
    };
    let opts = QuantizeOptions {
        threads: a.threads,
        progress: Some(progress(a.output.display().to_string())),
    };
    let rep = quantize_gguf(&a.input, &a.output, &target, opts).map_err(|e| e.to_string())?;
    let types: Vec<String> = rep.types.iter().map(|(t, n)| format!("{n} {t}")).collect();
    eprintln!(
        "{} tensors requantized, {} copied; types: {}",
        rep.requantized,
        rep.copied,
        types.join(", ")
    );
    Ok(rep.summary)
}

fn run_split_mtp(a: SplitMtpArgs) -> Result<WriteSummary, String> {
    let (main, mtp) = split_mtp(&a.input, &a.main_out, &a.mtp_out).map_err(|e| e.to_string())?;
    report(&main);
    Ok(mtp)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let res = match cli.cmd {
        Cmd::Random(a) => run_random(a),
        Cmd::Convert(a) => run_convert(a),
        Cmd::Quantize(a) => run_quantize(a),
        Cmd::SplitMtp(a) => run_split_mtp(a),
    };
    match res {
        Ok(s) => {
            report(&s);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("strata-gguf: error: {e}");
            ExitCode::FAILURE
        }
    }
}
