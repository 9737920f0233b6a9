//! The command line, and the settings a sweep runs with once the modes are applied.

use std::path::PathBuf;

use attn_benches::catalog::{Dtype, Engine, Workload};
use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::error::ErrorKind;
use clap::{Args, CommandFactory, Parser, Subcommand};

/// attn workspace automation.
#[derive(Debug, Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask")]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The xtask commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// The scaling report: time and peak memory against sequence length for every engine,
    /// the GEMM and bandwidth roofs, fitted exponents; written to target/bench-report/.
    Bench(BenchArgs),
    /// Every test: `cargo test --workspace`, then the Python extension's pytest suite
    /// (a virtualenv in target/python-venv, maturin, NumPy, pytest). `--skip cargo,python`.
    Test(crate::test::TestArgs),
    /// The output bits of every public entry point of attn-optimized, written to a file
    /// (release build): run it in two worktrees on the same CPU and `cmp` the files to
    /// prove that a change keeps every bit.
    Bits(BitsArgs),
}

/// Flags of `cargo xtask bits`.
#[derive(Debug, Args)]
pub struct BitsArgs {
    /// Where to write the bits.
    #[arg(long, default_value = "target/attn.bits")]
    pub out: PathBuf,
}

fn engine_parser() -> impl TypedValueParser<Value = Engine> {
    PossibleValuesParser::new(Engine::NAMES)
        .map(|name| Engine::from_name(&name).expect("clap only passes listed names"))
}

fn dtype_parser() -> impl TypedValueParser<Value = Dtype> {
    PossibleValuesParser::new(Dtype::NAMES)
        .map(|name| Dtype::from_name(&name).expect("clap only passes listed names"))
}

/// A finite, positive number of seconds.
fn positive_seconds(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(s) if s.is_finite() && s > 0.0 => Ok(s),
        _ => Err(format!(
            "expected a positive number of seconds, got `{text}`"
        )),
    }
}

/// Flags of `cargo xtask bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Largest sequence length n of the sweep [default: 16384, 4096 with --quick; with
    /// --decode 262144, 65536 with --quick]; the materialising engines stop earlier (their
    /// score matrices are capped at 512 MiB).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_n: Option<u64>,

    /// Smallest sequence length n of the sweep, rounded up to a power of two
    /// [default: 256; 4096 with --decode].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub min_n: Option<u64>,

    /// Attention heads per call (one batch entry).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..))]
    pub heads: u64,

    /// Head width: d_k = d_v = d.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    pub d: u64,

    /// Threads for the engines and the roofs [default: all cores].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub threads: Option<u64>,

    /// Top-left causal mask (PyTorch `is_causal`) instead of none.
    #[arg(long)]
    pub causal: bool,

    /// Decode sweep: one query per head against n cached keys, judged in GB/s of K and V
    /// against the bandwidth roof. (A bottom-right causal mask lets the one query see every
    /// key, so the decode sweep is unmasked.)
    #[arg(long, conflicts_with = "causal")]
    pub decode: bool,

    /// Also sweep the backward pass (dQ, dK, dV from the upstream gradient, the operands
    /// and the forward's output and LSE, made before the measured call) of every engine
    /// that has one, in every swept dtype and with the same mask; reported in sections and
    /// plots of its own, with its FLOPs counted as 2.5 × the forward's.
    #[arg(long, conflicts_with = "decode")]
    pub backward: bool,

    /// Storage types to sweep, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "f32", value_parser = dtype_parser())]
    pub dtype: Vec<Dtype>,

    /// Engines to sweep, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "reference,baseline,optimized",
        value_parser = engine_parser()
    )]
    pub engines: Vec<Engine>,

    /// A shorter run: smaller n, fewer repetitions, smaller roofs.
    #[arg(long)]
    pub quick: bool,

    /// CI smoke test: n ∈ {64, 128}, 1 head, d = 16, tiny roofs; fails unless every
    /// supported case runs and the whole report is written. Overrides the size flags
    /// (combines with --causal, --decode, --backward, --dtype and --engines).
    #[arg(long, conflicts_with = "quick")]
    pub check: bool,

    /// Seconds the timed runs of one case may take [default: 20, 5 with --quick or --check].
    #[arg(long, value_parser = positive_seconds)]
    pub budget: Option<f64>,

    /// Timed runs per case after the warm-up [default: 5, 3 with --quick or --check].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub runs: Option<u64>,

    /// Report directory [default: <target dir>/bench-report, bench-report-check with --check].
    #[arg(long)]
    pub out: Option<PathBuf>,

    /// The benchmark page of this kind of machine: every sweep `docs/benchmarks.md`
    /// shows, run in turn into <target dir>/bench-doc/, and `docs/benchmarks/<cpu>.md`
    /// written from their reports (each table with its command, commit and CPU).
    #[arg(long, conflicts_with_all = ["check", "quick", "replot", "out"])]
    pub doc: bool,

    /// Measure nothing: redraw report.md and the plots of the report in this directory
    /// from its report.json.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["check", "quick"])]
    pub replot: Option<PathBuf>,
}

/// How a sweep runs, every default applied.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Which preset applied: "default", "quick" or "check".
    pub mode: &'static str,
    pub engines: Vec<Engine>,
    pub dtypes: Vec<Dtype>,
    pub workload: Workload,
    /// Backward cases after the forward ones.
    pub backward: bool,
    pub causal: bool,
    pub min_n: usize,
    pub max_n: usize,
    pub heads: usize,
    pub d: usize,
    pub threads: usize,
    pub runs: usize,
    pub budget_s: f64,
    /// Side of the GEMM roof.
    pub gemm_n: usize,
    /// Size of the bandwidth buffer.
    pub bandwidth_mib: usize,
    pub roof_runs: usize,
    pub out: Option<PathBuf>,
}

impl BenchArgs {
    /// Applies the presets; exits with a clap usage error (code 2) on inconsistent flags.
    pub fn resolve(self) -> Settings {
        let threads = self.threads.map_or_else(
            || std::thread::available_parallelism().map_or(1, |n| n.get()),
            |t| t as usize,
        );
        let mut engines = self.engines;
        engines.sort();
        engines.dedup();
        let mut dtypes = self.dtype;
        dtypes.sort();
        dtypes.dedup();
        let mut s = Settings {
            mode: "default",
            engines,
            dtypes,
            workload: if self.decode {
                Workload::Decode
            } else {
                Workload::SelfAttention
            },
            backward: self.backward,
            causal: self.causal,
            min_n: self
                .min_n
                .map_or(if self.decode { 4096 } else { 256 }, |n| n as usize),
            max_n: self
                .max_n
                .map_or(if self.decode { 1 << 18 } else { 16384 }, |n| n as usize),
            heads: self.heads as usize,
            d: self.d as usize,
            threads,
            runs: 5,
            budget_s: 20.0,
            gemm_n: 2048,
            bandwidth_mib: 1024,
            roof_runs: 5,
            out: self.out,
        };
        if self.quick {
            s.mode = "quick";
            s.max_n = self
                .max_n
                .map_or(if self.decode { 1 << 16 } else { 4096 }, |n| n as usize);
            s.runs = 3;
            s.budget_s = 5.0;
            s.gemm_n = 1024;
            s.bandwidth_mib = 256;
        }
        if self.check {
            s.mode = "check";
            s.min_n = 64;
            s.max_n = 128;
            s.heads = 1;
            s.d = 16;
            s.runs = 3;
            s.budget_s = 5.0;
            s.gemm_n = 256;
            s.bandwidth_mib = 64;
            s.roof_runs = 3;
        }
        if let Some(r) = self.runs {
            s.runs = r as usize;
        }
        if let Some(b) = self.budget {
            s.budget_s = b;
        }
        if s.max_n < s.min_n.next_power_of_two() {
            usage_error(
                ErrorKind::ArgumentConflict,
                format!(
                    "--max-n {} is below the smallest swept n ({}, from --min-n {})",
                    s.max_n,
                    s.min_n.next_power_of_two(),
                    s.min_n
                ),
            );
        }
        s
    }
}

/// Reports a usage error the way clap does (message, usage, exit code 2).
fn usage_error(kind: ErrorKind, message: String) -> ! {
    let mut cmd = Cli::command();
    let bench = cmd
        .find_subcommand_mut("bench")
        .expect("bench is a subcommand")
        .clone();
    drop(cmd);
    bench
        .bin_name("cargo xtask bench")
        .error(kind, message)
        .exit()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &str) -> Result<BenchArgs, clap::Error> {
        let argv = std::iter::once("xtask").chain(args.split_whitespace());
        Cli::try_parse_from(argv).map(|cli| match cli.command {
            Command::Bench(args) => args,
            Command::Test(_) | Command::Bits(_) => panic!("`{args}` parsed as another command"),
        })
    }

    #[test]
    fn test_takes_its_steps_and_pytest_arguments() {
        let argv = ["xtask", "test", "--skip", "python", "--", "-k", "kv_cache"];
        match Cli::try_parse_from(argv).expect("valid").command {
            Command::Test(t) => {
                assert_eq!(t.skip, vec![crate::test::Step::Python]);
                assert_eq!(t.pytest_args, ["-k", "kv_cache"]);
            }
            Command::Bench(_) | Command::Bits(_) => panic!("parsed as another command"),
        }
    }

    #[test]
    fn bad_input_is_a_usage_error_with_exit_code_2() {
        for args in [
            "bench --engines flash",
            "bench --engines baseline,nope",
            "bench --max-n 0",
            "bench --min-n 0",
            "bench --threads 0",
            "bench --heads 0",
            "bench --dtype f64",
            "bench --budget=-1",
            "bench --check --quick",
            "bench --decode --causal",
            "bench --decode --backward",
        ] {
            let err = parse(args).expect_err(args);
            assert_eq!(err.exit_code(), 2, "{args}");
        }
    }

    #[test]
    fn defaults_sweep_every_engine_in_f32() {
        let s = parse("bench").unwrap().resolve();
        assert_eq!(s.engines, Engine::ALL.to_vec());
        assert_eq!(s.dtypes, vec![Dtype::F32]);
        assert_eq!((s.min_n, s.max_n, s.heads, s.d), (256, 16384, 8, 64));
        assert!(!s.causal);
        assert!(!s.backward);
    }

    #[test]
    fn backward_combines_with_check_and_causal() {
        let s = parse("bench --check --backward --causal")
            .unwrap()
            .resolve();
        assert_eq!((s.mode, s.backward, s.causal), ("check", true, true));
        assert_eq!(s.workload, Workload::SelfAttention);
    }

    #[test]
    fn lists_are_comma_separated_and_deduplicated() {
        let s = parse("bench --engines optimized,baseline,optimized --dtype bf16,f32 --causal")
            .unwrap()
            .resolve();
        assert_eq!(s.engines, vec![Engine::Baseline, Engine::Optimized]);
        assert_eq!(s.dtypes, vec![Dtype::F32, Dtype::Bf16]);
        assert!(s.causal);
    }

    #[test]
    fn check_is_a_tiny_sweep_whatever_the_size_flags() {
        let s = parse("bench --check --max-n 65536 --heads 32")
            .unwrap()
            .resolve();
        assert_eq!(
            (s.mode, s.min_n, s.max_n, s.heads, s.d),
            ("check", 64, 128, 1, 16)
        );
    }
}
