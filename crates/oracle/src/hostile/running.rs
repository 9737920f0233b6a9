//! Running: no panics, no aborts, persisted failures.

use super::*;

thread_local! {
    static GUARDED: Cell<bool> = const { Cell::new(false) };
    static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
}

pub(super) static HOOK: Once = Once::new();

pub(super) fn install_hook() {
    HOOK.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            if GUARDED.with(Cell::get) {
                LAST_PANIC.with(|p| *p.borrow_mut() = Some(info.to_string()));
            } else {
                previous(info);
            }
        }));
    });
}

/// Runs `f` under `catch_unwind`: `Err` with the panic's message and location if it
/// panics (the panic is not printed). A panic on another thread (a rayon worker) that
/// `f` re-raises is reported with its message.
///
/// ```
/// use attn_oracle::hostile::guarded;
/// assert_eq!(guarded(|| 2 + 2), Ok(4));
/// let e = guarded(|| -> u8 { panic!("boom") }).unwrap_err();
/// assert!(e.contains("boom"));
/// ```
pub fn guarded<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    install_hook();
    let was = GUARDED.with(|g| g.replace(true));
    LAST_PANIC.with(|p| p.borrow_mut().take());
    let r = panic::catch_unwind(AssertUnwindSafe(f));
    GUARDED.with(|g| g.set(was));
    r.map_err(|payload| {
        let recorded = LAST_PANIC.with(|p| p.borrow_mut().take());
        recorded.unwrap_or_else(|| {
            payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_string()))
                .unwrap_or_else(|| "a panic with a non-string payload".into())
        })
    })
}

/// Runs `f` under [`guarded`]; a panic becomes `Err("<what> panicked: …")`.
pub fn returns<R>(what: &str, f: impl FnOnce() -> R) -> Result<R, String> {
    if std::env::var_os("ATTN_HOSTILE_TRACE").is_some() {
        eprintln!("hostile call: {what}");
    }
    guarded(f).map_err(|m| format!("{what} panicked (the library never panics on input): {m}"))
}

/// How many cases a hostile property runs and where its failures persist.
#[derive(Debug, Clone)]
pub struct HostileConfig {
    /// Cases per property (`None`: `PROPTEST_CASES`, else the property's default).
    pub cases: Option<u32>,
    /// Directory of the persisted failures (`<dir>/<property>.txt`).
    pub regressions: Option<PathBuf>,
    /// Shrink iterations.
    pub max_shrink_iters: u32,
}

impl HostileConfig {
    /// Default counts (or `PROPTEST_CASES`), failures persisted under
    /// `<manifest_dir>/proptest-regressions/<group>/`.
    pub fn for_crate(manifest_dir: &str, group: &str) -> Self {
        Self {
            cases: None,
            regressions: Some(
                PathBuf::from(manifest_dir)
                    .join("proptest-regressions")
                    .join(group),
            ),
            max_shrink_iters: 512,
        }
    }

    /// `cases` per property, nothing persisted.
    pub fn quick(cases: u32) -> Self {
        Self {
            cases: Some(cases),
            regressions: None,
            max_shrink_iters: 64,
        }
    }

    fn cases(&self, default: u32) -> u32 {
        self.cases.unwrap_or_else(|| {
            std::env::var("PROPTEST_CASES")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(default)
        })
    }
}

/// Runs one hostile property with proptest: `test` returns `Err(description)` for a
/// violation; the result is the shrunk failure, with the minimal input. The random seed
/// is fixed per property (the same cases on every run) unless `PROPTEST_RNG_SEED` is set.
///
/// Each case's input is printed to stderr first when the environment variable
/// `ATTN_HOSTILE_TRACE` is set (as [`isolated`] sets it in its child), so that the input
/// of an abort or a hang is known.
pub fn run_property<S>(
    name: &str,
    config: &HostileConfig,
    default_cases: u32,
    strategy: S,
    test: impl Fn(&S::Value) -> Result<(), String>,
) -> Result<(), String>
where
    S: Strategy,
    S::Value: fmt::Debug,
{
    let mut pc = Config {
        cases: config.cases(default_cases),
        max_shrink_iters: config.max_shrink_iters,
        ..Config::default()
    };
    pc.source_file = None;
    // A fixed seed per property, so that `cargo test` (CI) checks the same cases on every
    // run; `PROPTEST_RNG_SEED` explores others (deep runs).
    if std::env::var_os("PROPTEST_RNG_SEED").is_none() {
        let seed = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        pc.rng_seed = RngSeed::Fixed(seed);
    }
    pc.failure_persistence = config.regressions.as_ref().map(|dir| {
        let path = dir.join(format!("{name}.txt"));
        let path: &'static str = Box::leak(path.to_string_lossy().into_owned().into_boxed_str());
        Box::new(FileFailurePersistence::Direct(path)) as _
    });
    let trace = std::env::var_os("ATTN_HOSTILE_TRACE").is_some();
    let mut runner = TestRunner::new(pc);
    let result = runner.run(&strategy, |value| {
        if trace {
            eprintln!("hostile case: {value:?}");
        }
        test(&value).map_err(TestCaseError::fail)
    });
    match result {
        Ok(()) => Ok(()),
        Err(TestError::Fail(reason, value)) => Err(format!(
            "property `{name}` fails: {reason}\nminimal failing input: {value:#?}"
        )),
        Err(TestError::Abort(reason)) => Err(format!("property `{name}` aborted: {reason}")),
    }
}

/// Runs a `#[test]` in a child process so that an abort (an infallible allocation that
/// fails, a stack overflow) or a hang is a reported failure and not the end of the test
/// binary: the parent re-runs the test binary on `test_path` (its full name as
/// `cargo test` prints it) with `--exact`, under a virtual-memory limit of 8 GiB where
/// `sh` can set one, and fails with the child's report — including the last case it
/// started — if the child does not pass within `timeout`. In the child, `body` runs.
pub fn isolated(test_path: &str, timeout: Duration, body: impl FnOnce()) {
    const CHILD: &str = "ATTN_HOSTILE_CHILD";
    if std::env::var(CHILD).is_ok_and(|t| t == test_path) {
        body();
        return;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let args = [test_path, "--exact", "--nocapture", "--test-threads=1"];
    let mut cmd = if std::path::Path::new("/bin/sh").exists() {
        let mut c = Command::new("/bin/sh");
        c.arg("-c")
            .arg("ulimit -v 8388608 2>/dev/null; exec \"$0\" \"$@\"")
            .arg(&exe)
            .args(args);
        c
    } else {
        let mut c = Command::new(&exe);
        c.args(args);
        c
    };
    cmd.env(CHILD, test_path)
        .env("ATTN_HOSTILE_TRACE", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn the test binary");
    let pipe = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut r) = r {
                let mut bytes = Vec::new();
                let _ = r.read_to_end(&mut bytes);
                s = String::from_utf8_lossy(&bytes).into_owned();
            }
            s
        })
    };
    let out = pipe(child.stdout.take().map(|s| Box::new(s) as _));
    let err = pipe(child.stderr.take().map(|s| Box::new(s) as _));
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait for the child") {
            break Some(s);
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (out, err) = (
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default(),
    );
    let last_case = err
        .lines()
        .rev()
        .find(|l| l.starts_with("hostile case: "))
        .unwrap_or("(no case started)");
    let last_call = err
        .lines()
        .rev()
        .find(|l| l.starts_with("hostile call: "))
        .unwrap_or("(no call started)");
    let last_case = format!("{last_case}\nlast call started: {last_call}");
    let report: String = err
        .lines()
        .filter(|l| !l.starts_with("hostile case: ") && !l.starts_with("hostile call: "))
        .collect::<Vec<_>>()
        .join("\n");
    match status {
        None => panic!(
            "{test_path}: the child did not finish within {timeout:?} (a hang, or a valid huge \
             problem computed)\nlast case started: {last_case}\n{report}"
        ),
        Some(s) if s.success() && out.contains("1 passed") => {}
        Some(s) if s.success() => {
            panic!("{test_path}: the child ran no test (is the test path right?)\n{out}")
        }
        Some(s) => panic!(
            "{test_path}: the child failed ({}): {}\nlast case started: {last_case}\n{report}\n{out}",
            describe_status(&s),
            if report.contains("minimal failing input") {
                "a property failed"
            } else {
                "it aborted or crashed (a panic cannot do this: only an abort, a signal or an exit)"
            }
        ),
    }
}

pub(super) fn describe_status(s: &std::process::ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = s.signal() {
            return format!(
                "killed by signal {sig}{}",
                if sig == 6 { " (SIGABRT)" } else { "" }
            );
        }
    }
    format!("{s}")
}
