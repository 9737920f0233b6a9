//! The report's data, its JSON and Markdown forms, and the terminal table.

use std::fmt::Write as _;

use attn_benches::catalog::{Dtype, Engine, Pass, Workload};
use attn_benches::protocol::Status;
use serde::{Deserialize, Serialize};

use crate::fit::{PowerLaw, power_law, upper_half};
use crate::machine::Machine;

/// One case of the sweep, as written to `report.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    /// Self-attention (`n_q = n_k`) or decoding (`n_q = 1`).
    pub workload: Workload,
    pub engine: Engine,
    /// Forward or backward (reports written before `--backward` existed hold forward
    /// cases only).
    #[serde(default)]
    pub pass: Pass,
    pub dtype: Dtype,
    pub causal: bool,
    pub heads: usize,
    pub n_q: usize,
    pub n_k: usize,
    pub d: usize,
    pub threads: usize,
    /// Median seconds of the timed runs.
    pub median_s: Option<f64>,
    /// Every timed run, seconds.
    pub samples_s: Vec<f64>,
    /// The first (warm-up) run, seconds; its peak memory is `peak_mib`.
    pub warmup_s: Option<f64>,
    /// Useful FLOPs (`4·n_q·n_k·d` per head for the forward, 2.5 times that for the
    /// backward; causal counts the visible pairs) per second.
    pub gflops: Option<f64>,
    /// Median GFLOP/s of the GEMMs timed right before each timed run of this case.
    pub roof_gflops: Option<f64>,
    /// Those GEMM rates, one per timed run (they also feed the run's roof).
    #[serde(skip)]
    pub roof_samples: Vec<f64>,
    /// Median over the timed runs of `run GFLOP/s ÷ GFLOP/s of the GEMM timed just
    /// before it`: the fraction of the roof, with the machine's drift cancelled.
    pub roof_fraction: Option<f64>,
    /// Decode cases: bytes of K and V over the median time, GB/s (10⁹ B/s).
    pub gbs: Option<f64>,
    /// Decode cases: `gbs` over the bandwidth roof of this run.
    pub bandwidth_fraction: Option<f64>,
    /// Peak resident growth over the inputs during the first run, MiB.
    pub peak_mib: Option<f64>,
    /// False when the peak could not be reset after building the inputs (then an upper
    /// bound).
    pub peak_exact: bool,
    pub status: Status,
    pub message: Option<String>,
}

impl Record {
    /// "causal" or "none".
    pub fn mask(&self) -> &'static str {
        if self.causal { "causal" } else { "none" }
    }

    /// The rate the case is judged by: GB/s of K and V for decoding, GFLOP/s otherwise.
    pub fn rate(&self) -> String {
        match (self.workload, self.gbs, self.gflops) {
            (Workload::Decode, Some(g), _) => format!("{g:.1} GB/s"),
            (_, _, Some(g)) => format!("{g:.1} GFLOP/s"),
            _ => "–".into(),
        }
    }

    /// The fraction of the roof that judges the case (bandwidth for decoding, GEMM
    /// otherwise).
    pub fn of_roof(&self) -> Option<f64> {
        match self.workload {
            Workload::Decode => self.bandwidth_fraction,
            Workload::SelfAttention => self.roof_fraction,
        }
    }
}

/// A roof measured in this run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Roof {
    /// What was measured.
    pub what: String,
    /// "GFLOP/s" or "GB/s".
    pub unit: String,
    /// Every timed run (for the GEMM: those before and after the sweep).
    pub samples: Vec<f64>,
    /// Median of `samples`; `None` when the measurement failed.
    pub median: Option<f64>,
    /// Why the measurement failed, if it did.
    pub error: Option<String>,
}

/// Both roofs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Roofs {
    pub gemm: Roof,
    pub bandwidth: Roof,
}

/// The fitted exponents of one engine, pass and dtype.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Fit {
    pub workload: Workload,
    pub engine: Engine,
    #[serde(default)]
    pub pass: Pass,
    pub dtype: Dtype,
    pub causal: bool,
    /// The sweep points the fit used (the upper half of the successful ones).
    pub n_used: Vec<usize>,
    /// `time ∝ n^time_exponent`.
    pub time_exponent: Option<f64>,
    pub time_coefficient: Option<f64>,
    /// `peak memory ∝ n^memory_exponent`.
    pub memory_exponent: Option<f64>,
    pub memory_coefficient: Option<f64>,
    /// 2 for self-attention (each of the n² scores is computed), 1 for decoding.
    pub expected_time_exponent: f64,
    /// Self-attention, either pass: 2 for engines that keep `n × n` matrices, 1 for
    /// streaming ones.
    /// Decoding: 1 for materialising engines (a row of `n_k` scores per head); none for a
    /// streaming engine, whose growth over the inputs is its output plus fixed scratch.
    pub expected_memory_exponent: Option<f64>,
}

impl Fit {
    /// The time law, when it could be fitted.
    pub fn time(&self) -> Option<PowerLaw> {
        Some(PowerLaw {
            exponent: self.time_exponent?,
            coefficient: self.time_coefficient?,
        })
    }

    /// The memory law (bytes), when it could be fitted.
    pub fn memory(&self) -> Option<PowerLaw> {
        Some(PowerLaw {
            exponent: self.memory_exponent?,
            coefficient: self.memory_coefficient?,
        })
    }
}

/// The settings a report was produced with.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunSettings {
    pub mode: String,
    pub workload: Workload,
    /// Whether the backward pass was swept too.
    #[serde(default)]
    pub backward: bool,
    pub engines: Vec<Engine>,
    pub dtypes: Vec<Dtype>,
    pub causal: bool,
    pub min_n: usize,
    pub max_n: usize,
    pub heads: usize,
    pub d: usize,
    pub threads: usize,
    pub runs: usize,
    pub budget_s: f64,
}

/// Everything `report.json` holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    pub generated_by: String,
    /// Seconds since the Unix epoch when the run finished.
    pub finished_unix_s: u64,
    /// Wall-clock seconds of the whole run, build excluded.
    pub runtime_s: f64,
    pub settings: RunSettings,
    pub machine: Machine,
    /// The 1-minute load average when the sweep started and when it ended; above 0 means
    /// something else competed for the cores.
    pub load_average: [Option<f64>; 2],
    pub roofs: Roofs,
    pub records: Vec<Record>,
    pub fits: Vec<Fit>,
}

/// Fits every (pass, engine, dtype) group of successful records, in the order the groups
/// first appear.
pub fn fits(records: &[Record]) -> Vec<Fit> {
    let key = |r: &Record| (r.workload, r.pass, r.engine, r.dtype, r.causal);
    let mut groups: Vec<(Workload, Pass, Engine, Dtype, bool)> = Vec::new();
    for r in records {
        if !groups.contains(&key(r)) {
            groups.push(key(r));
        }
    }
    groups
        .into_iter()
        .filter_map(|(workload, pass, engine, dtype, causal)| {
            let mut ok: Vec<&Record> = records
                .iter()
                .filter(|r| key(r) == (workload, pass, engine, dtype, causal))
                .filter(|r| r.status == Status::Ok && r.median_s.is_some())
                .collect();
            if ok.is_empty() {
                return None;
            }
            ok.sort_by_key(|r| r.n_k);
            let used = upper_half(&ok);
            let time = power_law(
                &used
                    .iter()
                    .map(|r| (r.n_k as f64, r.median_s.unwrap_or(f64::NAN)))
                    .collect::<Vec<_>>(),
            );
            let memory = power_law(
                &used
                    .iter()
                    .filter_map(|r| Some((r.n_k as f64, r.peak_mib? * MIB)))
                    .collect::<Vec<_>>(),
            );
            Some(Fit {
                workload,
                engine,
                pass,
                dtype,
                causal,
                n_used: used.iter().map(|r| r.n_k).collect(),
                time_exponent: time.map(|f| f.exponent),
                time_coefficient: time.map(|f| f.coefficient),
                memory_exponent: memory.map(|f| f.exponent),
                memory_coefficient: memory.map(|f| f.coefficient),
                expected_time_exponent: match workload {
                    Workload::SelfAttention => 2.0,
                    Workload::Decode => 1.0,
                },
                expected_memory_exponent: match (workload, engine.materialises()) {
                    (Workload::SelfAttention, true) => Some(2.0),
                    (Workload::SelfAttention, false) | (Workload::Decode, true) => Some(1.0),
                    (Workload::Decode, false) => None,
                },
            })
        })
        .collect()
}

/// Bytes per MiB.
pub const MIB: f64 = 1024.0 * 1024.0;

fn opt(x: Option<f64>, f: impl Fn(f64) -> String) -> String {
    x.map_or_else(|| "–".into(), f)
}

/// Human-readable seconds.
pub fn seconds(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.2} s")
    } else if s >= 1e-3 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{:.1} µs", s * 1e6)
    }
}

/// The rows of the case table. Runs of unsupported cases of one engine collapse into one
/// row spanning their n.
fn case_rows(records: &[&Record]) -> Vec<[String; 9]> {
    let mut rows = Vec::new();
    let mut i = 0;
    while i < records.len() {
        let r = records[i];
        let mut j = i + 1;
        if r.status == Status::Unsupported {
            while j < records.len()
                && records[j].status == Status::Unsupported
                && (records[j].engine, records[j].dtype) == (r.engine, r.dtype)
            {
                j += 1;
            }
        }
        let n = if j - i > 1 {
            format!("{}–{}", r.n_k, records[j - 1].n_k)
        } else {
            r.n_k.to_string()
        };
        let n = match r.workload {
            Workload::SelfAttention => n,
            Workload::Decode => format!("1×{n}"),
        };
        let status = match (&r.status, &r.message) {
            (Status::Ok, _) => "ok".to_string(),
            (s, Some(m)) => format!("{} ({m})", s.name()),
            (s, None) => s.name().to_string(),
        };
        rows.push([
            r.engine.to_string(),
            r.dtype.to_string(),
            r.mask().to_string(),
            n,
            opt(r.median_s, seconds),
            if r.median_s.is_some() {
                r.rate()
            } else {
                "–".into()
            },
            // Three decimals below 0.1 so that the slow engines do not read as zero.
            opt(r.of_roof(), |f| {
                if f < 0.1 {
                    format!("{f:.3}")
                } else {
                    format!("{f:.2}")
                }
            }),
            opt(r.peak_mib, |m| {
                format!("{m:.1}{}", if r.peak_exact { "" } else { " (≤)" })
            }),
            status,
        ]);
        i = j;
    }
    rows
}

const CASE_HEADER: [&str; 9] = [
    "engine", "dtype", "mask", "n", "median", "rate", "of roof", "peak MiB", "status",
];

fn fit_rows(fits: &[&Fit]) -> Vec<[String; 6]> {
    fits.iter()
        .map(|f| {
            [
                f.engine.to_string(),
                f.dtype.to_string(),
                if f.causal { "causal" } else { "none" }.to_string(),
                f.n_used
                    .iter()
                    .map(|n| n.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                format!(
                    "{} (expect ≈ {})",
                    opt(f.time_exponent, |e| format!("{e:.2}")),
                    f.expected_time_exponent
                ),
                match f.expected_memory_exponent {
                    Some(x) => format!(
                        "{} (expect ≈ {x})",
                        opt(f.memory_exponent, |e| format!("{e:.2}"))
                    ),
                    None => format!(
                        "{} (output and scratch only)",
                        opt(f.memory_exponent, |e| format!("{e:.2}"))
                    ),
                },
            ]
        })
        .collect()
}

const FIT_HEADER: [&str; 6] = [
    "engine",
    "dtype",
    "mask",
    "fitted on n",
    "time exponent",
    "memory exponent",
];

/// A plain-text table with aligned columns (right-aligned except the first three and the
/// last, which are words).
fn text_table<const N: usize>(header: [&str; N], rows: &[[String; N]], left: &[usize]) -> String {
    let mut width = header.map(|h| h.chars().count());
    for row in rows {
        for (w, cell) in width.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (c, (cell, w)) in cells.iter().zip(width).enumerate() {
            let pad = w - cell.chars().count();
            if c > 0 {
                s.push_str("  ");
            }
            if left.contains(&c) || c == N - 1 {
                s.push_str(cell);
                if c != N - 1 {
                    s.push_str(&" ".repeat(pad));
                }
            } else {
                s.push_str(&" ".repeat(pad));
                s.push_str(cell);
            }
        }
        s.push('\n');
        s
    };
    let mut out = line(header.to_vec());
    out.push_str(&line(
        width
            .iter()
            .map(|&w| "─".repeat(w))
            .collect::<Vec<_>>()
            .iter()
            .map(String::as_str)
            .collect(),
    ));
    for row in rows {
        out.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    out
}

fn markdown_table<const N: usize>(
    header: [&str; N],
    rows: &[[String; N]],
    left: &[usize],
) -> String {
    let mut out = format!("| {} |\n|", header.join(" | "));
    for c in 0..N {
        out.push_str(if left.contains(&c) || c == N - 1 {
            " --- |"
        } else {
            " ---: |"
        });
    }
    out.push('\n');
    for row in rows {
        let _ = writeln!(out, "| {} |", row.join(" | "));
    }
    out
}

fn roof_line(roof: &Roof) -> String {
    match (roof.median, &roof.error) {
        (Some(m), _) => {
            let lo = roof.samples.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = roof
                .samples
                .iter()
                .copied()
                .fold(f64::NEG_INFINITY, f64::max);
            format!(
                "{}: {m:.1} {} (median of {}, range {lo:.1}–{hi:.1})",
                roof.what,
                roof.unit,
                roof.samples.len()
            )
        }
        (None, Some(e)) => format!("{}: failed ({e})", roof.what),
        (None, None) => format!("{}: not measured", roof.what),
    }
}

/// The passes a report holds cases of, in report order: the forward always, the backward
/// when it was swept.
fn passes(report: &Report) -> Vec<Pass> {
    Pass::ALL
        .into_iter()
        .filter(|&p| p == Pass::Forward || report.records.iter().any(|r| r.pass == p))
        .collect()
}

/// The records of one pass, in sweep order.
fn records_of(report: &Report, pass: Pass) -> Vec<&Record> {
    report.records.iter().filter(|r| r.pass == pass).collect()
}

/// The fits of one pass.
fn fits_of(report: &Report, pass: Pass) -> Vec<&Fit> {
    report.fits.iter().filter(|f| f.pass == pass).collect()
}

/// The terminal summary: roofs, cases, exponents; the backward pass's after the forward's.
pub fn terminal(report: &Report) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "{}", isa_line(&report.machine));
    let _ = writeln!(s, "{}", roof_line(&report.roofs.gemm));
    let _ = writeln!(s, "{}", roof_line(&report.roofs.bandwidth));
    for pass in passes(report) {
        if pass == Pass::Backward {
            s.push_str(
                "\nbackward pass (dQ, dK, dV from dO, Q, K, V, O and LSE; FLOPs counted as 2.5 × \
                 the forward's):\n",
            );
        }
        s.push('\n');
        s.push_str(&text_table(
            CASE_HEADER,
            &case_rows(&records_of(report, pass)),
            &[0, 1, 2],
        ));
        s.push('\n');
        s.push_str(&text_table(
            FIT_HEADER,
            &fit_rows(&fits_of(report, pass)),
            &[0, 1, 2, 3],
        ));
    }
    s
}

/// The CPU and the instruction sets the figures were measured with: a rate read against the
/// wrong machine (an AVX2-only CPU for an AVX-512 one) misleads.
fn isa_line(m: &Machine) -> String {
    let or_unknown = |x: &str| {
        if x.is_empty() {
            "unknown".to_string()
        } else {
            x.to_string()
        }
    };
    format!(
        "CPU: {} · attn kernels: {} · faer GEMM: {}",
        m.cpu,
        or_unknown(&m.kernels),
        or_unknown(&m.faer_gemm)
    )
}

/// `report.md`.
pub fn markdown(report: &Report, plots: &[(&str, &str)]) -> String {
    let st = &report.settings;
    let m = &report.machine;
    let mut s = String::from("# attn scaling report\n\n");
    let _ = writeln!(
        s,
        "`cargo xtask bench` ({} mode, {}{}): {} heads, d = {}, {} threads, mask {}, n from {} \
         to {} (capped per engine), {} timed runs per case after a warm-up (median reported), \
         {} s budget per case. Whole run: {:.0} s.\n",
        st.mode,
        match st.workload {
            Workload::SelfAttention => "self-attention, n_q = n_k = n",
            Workload::Decode => "decoding, n_q = 1, n_k = n",
        },
        if st.backward {
            "; forward and backward passes"
        } else {
            ""
        },
        st.heads,
        st.d,
        st.threads,
        if st.causal {
            "causal (top-left)"
        } else {
            "none"
        },
        st.min_n,
        st.max_n,
        st.runs,
        st.budget_s,
        report.runtime_s
    );
    let _ = writeln!(
        s,
        "Machine: {}, {} cores ({}), {} GiB, {}, {}.\n",
        m.cpu,
        m.cores,
        m.simd.join(", "),
        m.memory_gib.map_or("?".into(), |g| format!("{g:.0}")),
        m.os,
        m.rustc
    );
    let _ = writeln!(s, "{}\n", isa_line(m));
    let load = |l: Option<f64>| l.map_or("?".into(), |l| format!("{l:.2}"));
    let _ = writeln!(
        s,
        "Load average (1 min) at the start and end of the sweep: {} and {}.\n",
        load(report.load_average[0]),
        load(report.load_average[1])
    );
    s.push_str("## Roofs\n\n");
    let _ = writeln!(s, "- {}", roof_line(&report.roofs.gemm));
    let _ = writeln!(s, "- {}\n", roof_line(&report.roofs.bandwidth));
    s.push_str("## Cases\n\n");
    s.push_str(
        "*rate*: for self-attention, GFLOP/s counting `4·n_q·n_k·d` per head (causal: the \
         visible pairs only) over the median time; for decoding, GB/s of K and V \
         (`heads·n_k·d·2` elements) over the median time. *of roof*: for self-attention, the \
         median over the timed runs of the run's rate divided by the rate of the f32 GEMM \
         timed just before it (interleaved, so the machine's drift cancels); for decoding, \
         the rate over the bandwidth roof. *peak MiB*: the growth of the peak resident set \
         over the inputs during the first run, measured in a fresh child process per case.\n\n",
    );
    s.push_str(&markdown_table(
        CASE_HEADER,
        &case_rows(&records_of(report, Pass::Forward)),
        &[0, 1, 2],
    ));
    s.push_str("\n## Growth exponents\n\n");
    s.push_str(
        "Least-squares slope of log(time) and log(peak memory) against log(n) over the upper \
         half of each engine's sweep.\n\n",
    );
    s.push_str(&markdown_table(
        FIT_HEADER,
        &fit_rows(&fits_of(report, Pass::Forward)),
        &[0, 1, 2, 3],
    ));
    if passes(report).contains(&Pass::Backward) {
        s.push_str("\n## Backward pass\n\n");
        s.push_str(
            "Each case times one backward call: `dQ`, `dK` and `dV` from the upstream gradient \
             `dO`, the operands and the forward's output and LSE, all made (the forward by the \
             optimized engine) before the measured region. The reference recomputes its own \
             f64 forward and keeps `S`, `P`, `dP` and `dS` of every head (`n_q × n_k` each); \
             the optimized engine recomputes score tiles and keeps only `O(n·d)` per head. \
             *rate*: `backward FLOPs = 2.5 × 4·n_q·n_k·d` per head (the recompute of `S`, \
             then `dV`, `dP`, `dQ` and `dK`; causal: the visible pairs only) over the median \
             time; *of roof* against the same interleaved f32 GEMM as the forward cases. \
             *peak MiB*: the growth of the peak resident set over those inputs during the first \
             backward call (the gradients, the engine's partials and scratch, the reference's \
             matrices).\n\n",
        );
        s.push_str(&markdown_table(
            CASE_HEADER,
            &case_rows(&records_of(report, Pass::Backward)),
            &[0, 1, 2],
        ));
        s.push_str("\n### Backward growth exponents\n\n");
        s.push_str(
            "Fitted as the forward's. Expected: time ≈ n² for every engine; memory ≈ n for the \
             optimized engine, ≈ n² for the reference.\n\n",
        );
        s.push_str(&markdown_table(
            FIT_HEADER,
            &fit_rows(&fits_of(report, Pass::Backward)),
            &[0, 1, 2, 3],
        ));
    }
    if !plots.is_empty() {
        s.push_str("\n## Plots\n\n");
        for (file, title) in plots {
            let _ = writeln!(s, "![{title}]({file})\n");
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(engine: Engine, n: usize, status: Status, median_s: Option<f64>) -> Record {
        Record {
            workload: Workload::SelfAttention,
            engine,
            pass: Pass::Forward,
            dtype: Dtype::F32,
            causal: false,
            heads: 1,
            n_q: n,
            n_k: n,
            d: 64,
            threads: 2,
            median_s,
            samples_s: median_s.into_iter().collect(),
            warmup_s: median_s,
            gflops: median_s.map(|t| 1.0 / t),
            roof_gflops: None,
            roof_samples: Vec::new(),
            roof_fraction: None,
            gbs: None,
            bandwidth_fraction: None,
            peak_mib: median_s.map(|_| (n * n) as f64 / MIB),
            peak_exact: true,
            status,
            message: (status != Status::Ok).then(|| "why".into()),
        }
    }

    #[test]
    fn unsupported_runs_collapse_into_one_row() {
        let records = [
            record(Engine::Baseline, 256, Status::Ok, Some(1.0)),
            record(Engine::Optimized, 256, Status::Unsupported, None),
            record(Engine::Optimized, 512, Status::Unsupported, None),
            record(Engine::Optimized, 1024, Status::Unsupported, None),
        ];
        let rows = case_rows(&records.iter().collect::<Vec<_>>());
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[1][3], "256–1024");
        assert_eq!(rows[1][8], "unsupported (why)");
    }

    fn report(records: Vec<Record>, backward: bool) -> Report {
        let roof = |unit: &str| Roof {
            what: "roof".into(),
            unit: unit.into(),
            samples: vec![1.0],
            median: Some(1.0),
            error: None,
        };
        Report {
            generated_by: "test".into(),
            finished_unix_s: 0,
            runtime_s: 1.0,
            settings: RunSettings {
                mode: "check".into(),
                workload: Workload::SelfAttention,
                backward,
                engines: vec![Engine::Reference, Engine::Optimized],
                dtypes: vec![Dtype::F32],
                causal: false,
                min_n: 256,
                max_n: 2048,
                heads: 1,
                d: 64,
                threads: 2,
                runs: 3,
                budget_s: 5.0,
            },
            machine: Machine {
                cpu: "cpu".into(),
                kernels: "AVX-512".into(),
                faer_gemm: "AVX-512".into(),
                cores: 2,
                simd: Vec::new(),
                memory_gib: None,
                os: "os".into(),
                rustc: "rustc".into(),
            },
            load_average: [None, None],
            roofs: Roofs {
                gemm: roof("GFLOP/s"),
                bandwidth: roof("GB/s"),
            },
            fits: fits(&records),
            records,
        }
    }

    fn backward(mut r: Record) -> Record {
        r.pass = Pass::Backward;
        r
    }

    #[test]
    fn the_passes_are_fitted_and_reported_apart() {
        let quadratic = |engine, n: usize| record(engine, n, Status::Ok, Some((n * n) as f64));
        let mut records: Vec<Record> = [256, 512].map(|n| quadratic(Engine::Optimized, n)).to_vec();
        // Backward memory of the streaming engine grows as n.
        records.extend([256, 512, 1024].map(|n| {
            let mut r = backward(quadratic(Engine::Optimized, n));
            r.peak_mib = Some(n as f64 / MIB);
            r
        }));
        records.push(backward(quadratic(Engine::Reference, 256)));
        records.push(backward(quadratic(Engine::Reference, 512)));
        let report = report(records, true);
        let keys: Vec<_> = report.fits.iter().map(|f| (f.pass, f.engine)).collect();
        assert_eq!(
            keys,
            [
                (Pass::Forward, Engine::Optimized),
                (Pass::Backward, Engine::Optimized),
                (Pass::Backward, Engine::Reference),
            ]
        );
        let streaming = &report.fits[1];
        assert_eq!(streaming.n_used, vec![512, 1024]);
        assert!((streaming.memory_exponent.unwrap() - 1.0).abs() < 1e-9);
        assert_eq!(streaming.expected_memory_exponent, Some(1.0));
        assert_eq!(report.fits[2].expected_memory_exponent, Some(2.0));

        let md = markdown(&report, &[]);
        let (forward, back) = md
            .split_once("## Backward pass")
            .expect("a backward section");
        assert_eq!(forward.matches("| optimized | f32 | none |").count(), 2 + 1);
        assert_eq!(back.matches("| optimized | f32 | none |").count(), 3 + 1);
        assert_eq!(back.matches("| reference | f32 | none |").count(), 2 + 1);
        assert!(terminal(&report).contains("backward pass"));
    }

    #[test]
    fn a_forward_report_has_no_backward_section_and_old_json_reads_as_forward() {
        let records = vec![record(Engine::Optimized, 256, Status::Ok, Some(1.0))];
        let report = report(records, false);
        assert!(!markdown(&report, &[]).contains("Backward"));
        assert!(!terminal(&report).contains("backward"));
        // A report.json written before `--backward` existed has no pass anywhere.
        let mut json = serde_json::to_value(&report).unwrap();
        json["records"][0].as_object_mut().unwrap().remove("pass");
        json["fits"][0].as_object_mut().unwrap().remove("pass");
        json["settings"].as_object_mut().unwrap().remove("backward");
        let old: Report = serde_json::from_value(json).unwrap();
        assert_eq!(old.records[0].pass, Pass::Forward);
        assert_eq!(old.fits[0].pass, Pass::Forward);
        assert!(!old.settings.backward);
    }

    #[test]
    fn fits_use_the_successful_upper_half() {
        let mut records: Vec<Record> = [256, 512, 1024, 2048]
            .map(|n| record(Engine::Baseline, n, Status::Ok, Some((n * n) as f64 * 1e-9)))
            .to_vec();
        records.push(record(Engine::Baseline, 4096, Status::Timeout, None));
        let fits = fits(&records);
        assert_eq!(fits.len(), 1);
        assert_eq!(fits[0].n_used, vec![1024, 2048]);
        assert!((fits[0].time_exponent.unwrap() - 2.0).abs() < 1e-9);
        assert!((fits[0].memory_exponent.unwrap() - 2.0).abs() < 1e-9);
        assert_eq!(fits[0].expected_memory_exponent, Some(2.0));
    }
}
