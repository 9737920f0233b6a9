//! Runs one case of the scaling report: inputs, peak memory of the first run, then timed
//! runs within a budget. `xtask bench` calls this through the `attn-bench-runner` binary,
//! one child process per case.

use std::time::Instant;

use attn_core::{Causal, Error, Options};
use half::{bf16, f16};

use crate::catalog::{Dtype, Engine, Pass};
use crate::inputs::Qkv;
use crate::memory::{reset_peak, residency};
use crate::protocol::{CaseReport, CaseRequest, RoofReport, RoofRequest, Status, median};
use crate::roof::{GemmRoof, gemm_gflops, pool, read_bandwidth_gbs};
use crate::training::Steps;

/// Inputs of one case in the element type under test.
///
/// ```
/// use attn_benches::catalog::Dtype;
/// use attn_benches::runner::Buffers;
/// let b = Buffers::random(Dtype::Bf16, 2, 8, 8, 4, 1);
/// assert!(matches!(b, Buffers::Bf16(_)));
/// ```
#[derive(Debug, Clone)]
pub enum Buffers {
    /// f32 operands.
    F32(Qkv<f32>),
    /// f16 operands (the f32 values rounded to nearest).
    F16(Qkv<f16>),
    /// bf16 operands (the f32 values rounded to nearest).
    Bf16(Qkv<bf16>),
}

impl Buffers {
    /// Deterministic operands of `heads` heads (batch 1, `[B,H,S,D]` layout).
    pub fn random(dtype: Dtype, heads: usize, n_q: usize, n_k: usize, d: usize, seed: u64) -> Self {
        Self::random_grouped(dtype, [heads, heads], n_q, n_k, d, seed)
    }

    /// [`Buffers::random`] with `[heads, kv_heads]` query and K/V heads.
    pub fn random_grouped(
        dtype: Dtype,
        heads: [usize; 2],
        n_q: usize,
        n_k: usize,
        d: usize,
        seed: u64,
    ) -> Self {
        let x = Qkv::random_grouped(heads, n_q, n_k, d, seed);
        match dtype {
            Dtype::F32 => Buffers::F32(x),
            Dtype::F16 => Buffers::F16(x.map(f16::from_f32)),
            Dtype::Bf16 => Buffers::Bf16(x.map(bf16::from_f32)),
        }
    }
}

/// Why [`run_engine`] did not produce an output.
#[derive(Debug)]
pub enum RunError {
    /// The engine has no implementation for this element type; the text says why.
    Unsupported(&'static str),
    /// The engine rejected the call.
    Engine(Error),
}

impl std::fmt::Display for RunError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RunError::Unsupported(why) => write!(f, "unsupported ({why})"),
            RunError::Engine(e) => e.fmt(f),
        }
    }
}

impl From<Error> for RunError {
    fn from(e: Error) -> Self {
        RunError::Engine(e)
    }
}

/// Runs `engine` once on `inputs` in the current rayon pool and drops the output.
///
/// This match is the one place that says which engine runs in which element type: adding
/// an engine or a dtype is one arm here, and every pair without an arm is reported as
/// unsupported by the report rather than timed.
///
/// ```
/// use attn_benches::catalog::{Dtype, Engine};
/// use attn_benches::runner::{run_engine, Buffers, RunError};
/// use attn_core::Options;
/// let x = Buffers::random(Dtype::F32, 1, 4, 4, 8, 0);
/// assert!(run_engine(Engine::Baseline, &x, &Options::default()).is_ok());
/// let h = Buffers::random(Dtype::F16, 1, 4, 4, 8, 0);
/// assert!(matches!(
///     run_engine(Engine::Baseline, &h, &Options::default()),
///     Err(RunError::Unsupported(_))
/// ));
/// ```
pub fn run_engine(engine: Engine, inputs: &Buffers, options: &Options<'_>) -> Result<(), RunError> {
    use Buffers as B;
    use attn_optimized as optimized;
    use attn_reference as reference;
    match (engine, inputs) {
        (Engine::Reference, B::F32(x)) => keep(
            reference::Attention::batched(x.q(), x.k(), x.v(), options)
                .and_then(|call| call.forward())
                .map(|f| f.into_output()),
        ),
        (Engine::Reference, B::F16(x)) => keep(
            reference::Attention::batched(x.q(), x.k(), x.v(), options)
                .and_then(|call| call.forward())
                .map(|f| f.into_output()),
        ),
        (Engine::Reference, B::Bf16(x)) => keep(
            reference::Attention::batched(x.q(), x.k(), x.v(), options)
                .and_then(|call| call.forward())
                .map(|f| f.into_output()),
        ),
        (Engine::Baseline, B::F32(x)) => keep(crate::baseline::attention_batched(
            x.q(),
            x.k(),
            x.v(),
            options,
        )),
        (Engine::Optimized, B::F32(x)) => keep(
            optimized::Attention::batched(x.q(), x.k(), x.v(), options)
                .and_then(|call| call.forward(optimized::Par::rayon(0)))
                .map(|f| f.into_output()),
        ),
        (Engine::Optimized, B::F16(x)) => keep(
            optimized::Attention::batched(x.q(), x.k(), x.v(), options)
                .and_then(|call| call.forward(optimized::Par::rayon(0)))
                .map(|f| f.into_output()),
        ),
        (Engine::Optimized, B::Bf16(x)) => keep(
            optimized::Attention::batched(x.q(), x.k(), x.v(), options)
                .and_then(|call| call.forward(optimized::Par::rayon(0)))
                .map(|f| f.into_output()),
        ),
        // A pair without an arm above is reported, never timed. New engines (a decoding
        // engine, a new dtype) get their arms above and a variant in `catalog::Engine`.
        (Engine::Baseline, B::F16(_) | B::Bf16(_)) => Err(RunError::Unsupported(
            "the hand-written baseline is f32 only",
        )),
    }
}

/// Runs `engine`'s backward pass once on `inputs` (operands, upstream gradient and the
/// forward's output and LSE) in the current rayon pool and drops the gradients.
///
/// The backward counterpart of [`run_engine`], and like it the one place that says which
/// engine has a backward pass in which element type.
///
/// ```
/// use attn_benches::catalog::{Dtype, Engine};
/// use attn_benches::runner::{run_backward, RunError};
/// use attn_benches::training::Steps;
/// use attn_core::Options;
/// let opts = Options::default();
/// let s = Steps::random(Dtype::Bf16, 1, 4, 4, 8, 0, &opts).unwrap();
/// assert!(run_backward(Engine::Optimized, &s, &opts).is_ok());
/// assert!(run_backward(Engine::Reference, &s, &opts).is_ok());
/// assert!(matches!(run_backward(Engine::Baseline, &s, &opts), Err(RunError::Unsupported(_))));
/// ```
pub fn run_backward(engine: Engine, inputs: &Steps, options: &Options<'_>) -> Result<(), RunError> {
    use Steps as S;
    match (engine, inputs) {
        // The reference widens every storage type to f64.
        (Engine::Reference, S::F32(_) | S::F16(_) | S::Bf16(_)) => {
            Ok(inputs.reference_backward(options)?)
        }
        (Engine::Optimized, S::F32(_) | S::F16(_) | S::Bf16(_)) => Ok(inputs.backward(options)?),
        (Engine::Baseline, _) => Err(RunError::Unsupported(
            "the hand-written baseline has no backward pass",
        )),
    }
}

/// The inputs of one case: operands for a forward case; operands, upstream gradient and
/// the forward's results for a backward case.
enum CaseInputs {
    Forward(Buffers),
    Backward(Steps),
}

impl CaseInputs {
    /// Deterministic inputs of `request`'s pass and dtype with `heads` query and K/V heads
    /// of `n_q` queries and `n_k` keys (a backward case computes the optimized forward
    /// here, so that its output and LSE exist before anything is measured).
    fn random(
        request: &CaseRequest,
        [heads, kv_heads, n_q, n_k]: [usize; 4],
        options: &Options<'_>,
    ) -> Result<Self, Error> {
        let (r, heads) = (request, [heads, kv_heads]);
        Ok(match r.pass {
            Pass::Forward => CaseInputs::Forward(Buffers::random_grouped(
                r.dtype, heads, n_q, n_k, r.d, r.seed,
            )),
            Pass::Backward => CaseInputs::Backward(Steps::random_grouped(
                r.dtype, heads, n_q, n_k, r.d, r.seed, options,
            )?),
        })
    }

    /// One call of `engine` on these inputs.
    fn run(&self, engine: Engine, options: &Options<'_>) -> Result<(), RunError> {
        match self {
            CaseInputs::Forward(x) => run_engine(engine, x, options),
            CaseInputs::Backward(s) => run_backward(engine, s, options),
        }
    }
}

/// Keeps the output alive until here (so its allocation counts) and then drops it.
fn keep<T>(result: Result<T, Error>) -> Result<(), RunError> {
    std::hint::black_box(result?);
    Ok(())
}

/// Options of a case: a top-left causal mask or none, default scale `1/√d`.
pub fn case_options(causal: bool) -> Options<'static> {
    let options = Options::default();
    if causal {
        options.with_causal(Causal::TopLeft)
    } else {
        options
    }
}

/// Runs one case in a pool of `request.threads` threads: builds the inputs (for a
/// backward case also the forward's output and LSE), measures the first run's peak memory
/// growth and time, then times up to `request.runs` more runs while they fit in
/// `request.budget_s`, each right after a GEMM of the roof when `request.roof_gemm_n` is
/// set. A first run longer than the budget ends the case as a timeout (with its time and
/// memory in the report).
///
/// ```
/// use attn_benches::catalog::{Dtype, Engine, Pass};
/// use attn_benches::protocol::{CaseRequest, Status};
/// use attn_benches::runner::run_case;
/// let report = run_case(&CaseRequest::new(Engine::Baseline, Dtype::F32, 32, 8));
/// assert_eq!(report.status, Status::Ok);
/// assert_eq!(report.samples_s.len(), 5);
/// let report = run_case(&CaseRequest::new(Engine::Baseline, Dtype::Bf16, 32, 8));
/// assert_eq!(report.status, Status::Unsupported);
/// let backward = CaseRequest { pass: Pass::Backward, ..CaseRequest::new(Engine::Optimized, Dtype::F16, 32, 8) };
/// assert_eq!(run_case(&backward).status, Status::Ok);
/// let backward = CaseRequest { engine: Engine::Baseline, ..backward };
/// assert_eq!(run_case(&backward).status, Status::Unsupported);
/// ```
pub fn run_case(request: &CaseRequest) -> CaseReport {
    let r = request;
    let options = case_options(r.causal);
    pool(r.threads).install(|| {
        // A tiny call first: it tells whether the pair is supported before the real inputs
        // are built, and starts the pool's threads so their stacks are not counted below.
        let probe = match CaseInputs::random(r, [1, 1, 2, 2], &options) {
            Ok(probe) => probe,
            Err(e) => return CaseReport::without_timings(Status::Failed, e.to_string()),
        };
        match probe.run(r.engine, &options) {
            Ok(()) => {}
            Err(RunError::Unsupported(why)) => {
                return CaseReport::without_timings(Status::Unsupported, why);
            }
            Err(e) => return CaseReport::without_timings(Status::Failed, e.to_string()),
        }
        drop(probe);
        // The roof's operands exist before the peak is reset, so they are not counted as
        // the engine's memory.
        let mut roof = r.roof_gemm_n.map(|n| {
            let mut g = GemmRoof::new(n, r.threads);
            g.run();
            g
        });

        // Everything the call reads exists before the peak is reset: for a backward case
        // that includes the upstream gradient and the forward's output and LSE.
        let inputs = match CaseInputs::random(r, [r.heads, r.kv_heads(), r.n_q, r.n_k], &options) {
            Ok(inputs) => inputs,
            Err(e) => return CaseReport::without_timings(Status::Failed, e.to_string()),
        };
        let peak_exact = reset_peak();
        let before = residency();
        let start = Instant::now();
        let first = inputs.run(r.engine, &options);
        let warmup_s = start.elapsed().as_secs_f64();
        let after = residency();
        if let Err(e) = first {
            return CaseReport::without_timings(Status::Failed, e.to_string());
        }
        let mut report = CaseReport {
            status: Status::Ok,
            message: None,
            warmup_s: Some(warmup_s),
            samples_s: Vec::new(),
            median_s: None,
            roof_gflops: Vec::new(),
            roof_fraction: None,
            rss_inputs_bytes: before.map(|b| b.rss_bytes),
            peak_growth_bytes: before
                .zip(after)
                .map(|(b, a)| a.peak_bytes.saturating_sub(b.rss_bytes)),
            peak_exact,
        };
        if warmup_s > r.budget_s {
            report.status = Status::Timeout;
            report.message = Some(format!(
                "the first run took {warmup_s:.2} s, over the {:.1} s budget",
                r.budget_s
            ));
            return report;
        }
        // At least one timed run; then more while the next one (with its GEMM) is expected
        // to fit.
        let flops = r.pass.flops(r.heads, r.n_q, r.n_k, r.d, r.causal);
        let mut fractions = Vec::new();
        let mut spent = 0.0;
        while report.samples_s.len() < r.runs.max(1) {
            let done = report.samples_s.len();
            if done > 0 && spent + spent / done as f64 > r.budget_s {
                break;
            }
            let mut roof_s = 0.0;
            if let Some(g) = roof.as_mut() {
                roof_s = g.time();
                report.roof_gflops.push(g.flops() / roof_s / 1e9);
            }
            let start = Instant::now();
            if let Err(e) = inputs.run(r.engine, &options) {
                report.status = Status::Failed;
                report.message = Some(e.to_string());
                return report;
            }
            let t = start.elapsed().as_secs_f64();
            if let Some(g) = roof.as_ref() {
                fractions.push((flops / t) / (g.flops() / roof_s));
            }
            spent += t + roof_s;
            report.samples_s.push(t);
        }
        report.median_s = median(&report.samples_s);
        report.roof_fraction = median(&fractions);
        report
    })
}

/// Measures one roof (see [`crate::roof`]).
///
/// ```
/// use attn_benches::protocol::RoofRequest;
/// let r = attn_benches::runner::run_roof(&RoofRequest::Gemm { n: 32, threads: 1, runs: 3 });
/// assert_eq!(r.samples.len(), 3);
/// assert!(r.median > 0.0);
/// ```
pub fn run_roof(request: &RoofRequest) -> RoofReport {
    let samples = match *request {
        RoofRequest::Gemm { n, threads, runs } => gemm_gflops(n, threads, runs.max(1)),
        RoofRequest::Bandwidth { mib, threads, runs } => {
            read_bandwidth_gbs(mib, threads, runs.max(1))
        }
    };
    RoofReport {
        request: request.clone(),
        median: median(&samples).unwrap_or(f64::NAN),
        samples,
    }
}
