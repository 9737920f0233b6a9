//! The sweep: roofs, every case in a child process, then the report files.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use attn_benches::catalog::{Dtype, Engine, Pass, Workload, kv_bytes, sweep};
use attn_benches::protocol::{CaseReport, CaseRequest, RoofReport, RoofRequest, Status, median};
use indicatif::{ProgressBar, ProgressStyle};

use crate::child::{ChildError, ask, build_runner, workspace_root};
use crate::cli::Settings;
use crate::machine::{Machine, load_average};
use crate::plot;
use crate::report::{self, MIB, Record, Report, Roof, Roofs, RunSettings};

/// Seed of every case's inputs: the same bits in every run and on every machine.
const SEED: u64 = 0x5eed_a77e;

/// Where the report goes: `--out`, else `<target dir>/bench-report` (`bench-report-check`
/// for `--check`).
fn report_dir(settings: &Settings) -> PathBuf {
    if let Some(out) = &settings.out {
        return out.clone();
    }
    let root = workspace_root();
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), |t| root.join(t));
    // The CI smoke test must not overwrite a real report.
    target.join(if settings.mode == "check" {
        "bench-report-check"
    } else {
        "bench-report"
    })
}

/// One planned case: an (engine, pass, dtype) triple at one n.
struct Planned {
    engine: Engine,
    pass: Pass,
    dtype: Dtype,
    n: usize,
}

/// Every forward case, then (with `--backward`) every backward case, each pass in
/// dtype, engine and n order.
fn plan(s: &Settings) -> Vec<Planned> {
    let passes: &[Pass] = if s.backward {
        &[Pass::Forward, Pass::Backward]
    } else {
        &[Pass::Forward]
    };
    let mut cases = Vec::new();
    for &pass in passes {
        for &dtype in &s.dtypes {
            for &engine in &s.engines {
                let cap = engine
                    .cap(pass, s.workload, s.min_n, s.max_n, s.heads, s.threads)
                    .unwrap_or(0);
                for n in sweep(s.min_n, cap) {
                    cases.push(Planned {
                        engine,
                        pass,
                        dtype,
                        n,
                    });
                }
            }
        }
    }
    cases
}

fn measure_roof(runner: &Path, request: RoofRequest) -> Result<RoofReport, String> {
    ask::<_, RoofReport>(runner, "roof", &request, Duration::from_secs(300)).map_err(|e| match e {
        ChildError::Timeout(d) => format!("no answer within {} s", d.as_secs()),
        ChildError::Failed(m) => m,
    })
}

fn roof_from(what: String, unit: &str, measured: Vec<Result<RoofReport, String>>) -> Roof {
    let samples: Vec<f64> = measured
        .iter()
        .flatten()
        .flat_map(|r| r.samples.clone())
        .collect();
    let error = measured.iter().find_map(|r| r.as_ref().err().cloned());
    Roof {
        what,
        unit: unit.into(),
        median: median(&samples),
        samples,
        error,
    }
}

/// Runs the whole report.
pub fn run(s: &Settings) -> Result<(), String> {
    let runner = build_runner()?;
    let started = Instant::now();
    let machine = Machine::describe(&runner);
    let load_start = load_average();
    let cases = plan(s);
    // Two GEMM measurements (before and after the cases, to bracket the drift) and one
    // bandwidth measurement.
    let roof_steps = if s.workload == Workload::Decode { 4 } else { 3 };
    let bar = ProgressBar::new(cases.len() as u64 + roof_steps);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:32}] {pos}/{len} {msg}")
            .expect("the template is valid")
            .progress_chars("=> "),
    );
    let say = |line: String| bar.suspend(|| eprintln!("{line}"));

    let gemm = RoofRequest::Gemm {
        n: s.gemm_n,
        threads: s.threads,
        runs: s.roof_runs,
    };
    let bandwidth = RoofRequest::Bandwidth {
        mib: s.bandwidth_mib,
        threads: s.threads,
        runs: s.roof_runs,
    };
    bar.set_message(format!("roof: f32 GEMM {}³", s.gemm_n));
    let gemm_before = measure_roof(&runner, gemm.clone());
    bar.inc(1);
    bar.set_message(format!("roof: read bandwidth over {} MiB", s.bandwidth_mib));
    let mut bandwidth_runs = vec![measure_roof(&runner, bandwidth.clone())];
    bar.inc(1);
    if let Ok(g) = &gemm_before {
        say(format!(
            "GEMM roof {:.1} GFLOP/s ({} threads)",
            g.median, s.threads
        ));
    }

    let mut records = Vec::with_capacity(cases.len());
    // An (engine, pass, dtype) triple stops at its first unsupported, failed or timed-out
    // case.
    let mut stopped: Vec<((Engine, Pass, Dtype), Status, String)> = Vec::new();
    for case in &cases {
        let key = (case.engine, case.pass, case.dtype);
        let name = match (s.workload, case.pass) {
            (Workload::SelfAttention, Pass::Forward) => {
                format!("{} {} n={}", case.engine, case.dtype, case.n)
            }
            (Workload::SelfAttention, Pass::Backward) => {
                format!("{} {} backward n={}", case.engine, case.dtype, case.n)
            }
            (Workload::Decode, _) => {
                format!("{} {} decode n_k={}", case.engine, case.dtype, case.n)
            }
        };
        bar.set_message(name.clone());
        let request = CaseRequest {
            engine: case.engine,
            pass: case.pass,
            dtype: case.dtype,
            causal: s.causal,
            heads: s.heads,
            kv_heads: None,
            n_q: s.workload.queries(case.n),
            n_k: case.n,
            d: s.d,
            threads: s.threads,
            runs: s.runs,
            budget_s: s.budget_s,
            seed: SEED,
            // Decoding is judged against the bandwidth, not the GEMM.
            roof_gemm_n: (s.workload == Workload::SelfAttention).then_some(s.gemm_n),
        };
        let outcome = match stopped.iter().find(|(k, _, _)| *k == key) {
            Some((_, Status::Unsupported, why)) => {
                CaseReport::without_timings(Status::Unsupported, why.clone())
            }
            Some((_, _, why)) => CaseReport::without_timings(Status::Skipped, why.clone()),
            None => {
                // The child gets the whole budget for timed runs plus its warm-up (at most
                // one budget), input generation and start-up.
                let deadline = Duration::from_secs_f64(3.0 * s.budget_s + 60.0);
                let outcome = match ask::<_, CaseReport>(&runner, "case", &request, deadline) {
                    Ok(report) => report,
                    Err(ChildError::Timeout(d)) => CaseReport::without_timings(
                        Status::Timeout,
                        format!("killed after {} s", d.as_secs()),
                    ),
                    Err(ChildError::Failed(m)) => CaseReport::without_timings(Status::Failed, m),
                };
                match outcome.status {
                    Status::Ok | Status::Skipped => {}
                    Status::Unsupported => stopped.push((
                        key,
                        Status::Unsupported,
                        outcome.message.clone().unwrap_or_default(),
                    )),
                    status => stopped.push((
                        key,
                        status,
                        format!("n = {} already ended with {}", case.n, status.name()),
                    )),
                }
                outcome
            }
        };
        let record = record(s, &request, outcome);
        if record.status != Status::Unsupported
            || records.last().is_none_or(|r: &Record| {
                (r.engine, r.pass, r.dtype) != (record.engine, record.pass, record.dtype)
            })
        {
            say(progress_line(&name, &record));
        }
        records.push(record);
        bar.inc(1);
    }

    bar.set_message(format!("roof: f32 GEMM {}³ again", s.gemm_n));
    let gemm_after = measure_roof(&runner, gemm.clone());
    bar.inc(1);
    if s.workload == Workload::Decode {
        // The decode cases are judged against the bandwidth: bracket the drift.
        bar.set_message(format!(
            "roof: read bandwidth over {} MiB again",
            s.bandwidth_mib
        ));
        bandwidth_runs.push(measure_roof(&runner, bandwidth));
    }
    bar.finish_and_clear();

    // The GEMMs timed inside the cases are samples of the same roof.
    let interleaved = Ok(RoofReport {
        request: gemm.clone(),
        samples: records
            .iter()
            .flat_map(|r| r.roof_samples.clone())
            .collect(),
        median: f64::NAN,
    });
    let roofs = Roofs {
        gemm: roof_from(
            format!(
                "f32 GEMM {0}×{0}×{0} (faer, {1} threads), timed before the sweep, before every \
                 timed run of every case, and after the sweep",
                s.gemm_n, s.threads
            ),
            "GFLOP/s",
            vec![gemm_before, interleaved, gemm_after],
        ),
        bandwidth: roof_from(
            format!(
                "read bandwidth, parallel f32 sum over {} MiB ({} threads)",
                s.bandwidth_mib, s.threads
            ),
            "GB/s",
            bandwidth_runs,
        ),
    };
    for r in &mut records {
        r.bandwidth_fraction = r.gbs.zip(roofs.bandwidth.median).map(|(g, b)| g / b);
    }
    let fits = report::fits(&records);
    let report = Report {
        generated_by: "cargo xtask bench".into(),
        finished_unix_s: SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        runtime_s: started.elapsed().as_secs_f64(),
        settings: RunSettings {
            mode: s.mode.into(),
            workload: s.workload,
            backward: s.backward,
            engines: s.engines.clone(),
            dtypes: s.dtypes.clone(),
            causal: s.causal,
            min_n: s.min_n,
            max_n: s.max_n,
            heads: s.heads,
            d: s.d,
            threads: s.threads,
            runs: s.runs,
            budget_s: s.budget_s,
        },
        machine,
        load_average: [load_start, load_average()],
        roofs,
        records,
        fits,
    };
    println!("{}", report::terminal(&report));

    let dir = report_dir(s);
    write(&report, &dir)?;
    println!(
        "report: {} ({:.0} s)",
        dir.join("report.md").display(),
        report.runtime_s
    );
    if s.mode == "check" {
        check(&report, &dir)?;
        println!("check: ok");
    }
    Ok(())
}

fn record(s: &Settings, req: &CaseRequest, outcome: CaseReport) -> Record {
    let gflops = outcome.median_s.map(|t| {
        req.pass
            .flops(req.heads, req.n_q, req.n_k, req.d, req.causal)
            / t
            / 1e9
    });
    let gbs = outcome
        .median_s
        .filter(|_| s.workload == Workload::Decode)
        .map(|t| kv_bytes(req.heads, req.n_k, req.d, req.dtype) / t / 1e9);
    Record {
        workload: s.workload,
        engine: req.engine,
        pass: req.pass,
        dtype: req.dtype,
        causal: req.causal,
        heads: req.heads,
        n_q: req.n_q,
        n_k: req.n_k,
        d: req.d,
        threads: s.threads,
        median_s: outcome.median_s,
        samples_s: outcome.samples_s,
        warmup_s: outcome.warmup_s,
        gflops,
        roof_gflops: median(&outcome.roof_gflops),
        roof_samples: outcome.roof_gflops,
        roof_fraction: outcome.roof_fraction,
        gbs,
        bandwidth_fraction: None,
        peak_mib: outcome.peak_growth_bytes.map(|b| b as f64 / MIB),
        peak_exact: outcome.peak_exact,
        status: outcome.status,
        message: outcome.message,
    }
}

fn progress_line(name: &str, r: &Record) -> String {
    match (r.status, r.median_s) {
        (Status::Ok, Some(t)) => format!(
            "{name}: {} ({} runs), {}{}, peak +{:.1} MiB",
            report::seconds(t),
            r.samples_s.len(),
            r.rate(),
            r.roof_fraction
                .map_or(String::new(), |f| format!(" ({f:.2} of the GEMM roof)")),
            r.peak_mib.unwrap_or(f64::NAN)
        ),
        (status, None) => format!("{name}: {}", status.name()),
        (status, Some(m)) => format!("{name}: {} ({m})", status.name()),
    }
}

fn write(report: &Report, dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let json = serde_json::to_string_pretty(report).expect("the report serialises");
    std::fs::write(dir.join("report.json"), json)
        .map_err(|e| format!("cannot write report.json: {e}"))?;
    plot::write_all(report, dir).map_err(|e| format!("cannot draw the plots: {e}"))?;
    let md = report::markdown(report, &plot::plots(&report.settings));
    std::fs::write(dir.join("report.md"), md)
        .map_err(|e| format!("cannot write report.md: {e}"))?;
    Ok(())
}

/// `--check`: the report must be complete and every supported case must have run.
fn check(report: &Report, dir: &Path) -> Result<(), String> {
    let mut problems = Vec::new();
    for r in &report.records {
        if !matches!(r.status, Status::Ok | Status::Unsupported) {
            problems.push(format!(
                "{} {} {} n={}: {} {}",
                r.engine,
                r.pass,
                r.dtype,
                r.n_k,
                r.status.name(),
                r.message.as_deref().unwrap_or("")
            ));
        }
    }
    if !report.records.iter().any(|r| r.status == Status::Ok) {
        problems.push("no case ran".into());
    }
    if report.settings.backward
        && !report
            .records
            .iter()
            .any(|r| r.pass == Pass::Backward && r.status == Status::Ok)
    {
        problems.push("no backward case ran".into());
    }
    for roof in [&report.roofs.gemm, &report.roofs.bandwidth] {
        if roof.median.is_none() {
            problems.push(format!(
                "{}: {}",
                roof.what,
                roof.error.as_deref().unwrap_or("not measured")
            ));
        }
    }
    let files = ["report.md", "report.json"]
        .into_iter()
        .chain(plot::plots(&report.settings).into_iter().map(|p| p.0));
    for file in files {
        match std::fs::metadata(dir.join(file)) {
            Ok(m) if m.len() > 0 => {}
            _ => problems.push(format!("{file} was not written")),
        }
    }
    match std::fs::read_to_string(dir.join("report.json"))
        .map(|t| serde_json::from_str::<serde_json::Value>(&t))
    {
        Ok(Ok(v))
            if v["records"]
                .as_array()
                .is_some_and(|a| a.len() == report.records.len()) => {}
        _ => problems.push("report.json does not read back".into()),
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(format!("check failed:\n  {}", problems.join("\n  ")))
    }
}

/// `--replot`: redraws `report.md` and the plots of an existing report from its
/// `report.json`, measuring nothing.
pub fn replot(dir: &Path) -> Result<(), String> {
    let path = dir.join("report.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let report: Report = serde_json::from_str(&text)
        .map_err(|e| format!("{} is not a report: {e}", path.display()))?;
    println!("{}", report::terminal(&report));
    write(&report, dir)?;
    println!("redrawn: {}", dir.join("report.md").display());
    Ok(())
}
