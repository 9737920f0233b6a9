//! `cargo xtask test`: every test of the workspace, on a fresh machine, in one command.
//!
//! The command runs a list of steps in order and stops at the first that fails:
//!
//! 1. `setup`: the system packages the workspace builds against. `attn-ring` links the
//!    system MPI through bindgen, so `cargo build --workspace` needs `mpicc`/`mpirun`
//!    (Debian: `libopenmpi-dev openmpi-bin`) and libclang (`libclang-dev`). The step looks
//!    for them and, when one is missing, runs `apt-get update` and
//!    `apt-get install -y` the missing packages (non-interactive; the machines are Debian
//!    and the command runs as root), printing what it does; without apt-get, or not as
//!    root, it fails and names the packages to install;
//! 2. `cargo`: `cargo test --workspace` (every crate's tests, doctests and properties, and
//!    tidy; attn-optimized's conformance suite runs itself again on each other kernel path
//!    this CPU supports, `ATTN_ISA=avx2` and `baseline` on an AVX-512 machine);
//! 3. `python`: the extension module `attn` (crates/python) and its pytest suite, torch
//!    and `transformers` included. The step creates a virtualenv under the target directory
//!    (`target/python-venv`) with the interpreter given by `--python`, `$PYTHON` or
//!    `python3`, and installs `crates/python/requirements-test.txt` into it (maturin,
//!    NumPy, pytest, and torch and transformers at pinned versions) only when its
//!    requirements change, from a wheel cache, `target/python-wheels`: `pip download` fills
//!    it once per list of requirements and interpreter (torch brings its CUDA libraries
//!    from PyPI, 3.1 GB of wheels), then `pip install --no-index` installs from it alone,
//!    so a warm machine downloads nothing even when the virtualenv is made again. It builds and
//!    installs the extension with `maturin develop --release` (sharing the release build of
//!    the workspace's crates) and runs `pytest crates/python/tests` with
//!    `ATTN_TEST_NO_SKIP=1`: everything the suite needs is installed here, so a missing
//!    torch is an import error and any skip a failure (a plain `pytest` without torch still
//!    skips the torch tests). pytest's "no tests collected" (exit 5) is a failure too: a
//!    suite that ran nothing has not passed. The suite's `torch.compile` tests need
//!    inductor's C++ toolchain: a C++ compiler (`$CXX`, else `g++`) and the virtualenv's
//!    `Python.h`; missing ones are apt-get installed (`g++`, `python3-dev`) as in `setup`.
//! 4. `mpi`: the ring's MPI tests for real: builds `attn-ring`'s `ring_mpi` test binary
//!    and runs it under `mpirun -np P` for P = 1, 2, 3 and 4 (`--oversubscribe`: more
//!    ranks than cores; `--allow-run-as-root` as root; `--bind-to none`, so that a rank's
//!    threads are not pinned to one core). Every rank checks every case; any failure on
//!    any rank fails the step. Then it builds `ring_faults` with attn-ring's test-only
//!    `fault-injection` feature and runs it for P = 2, 3 and 4: a chosen rank fails at a
//!    chosen step, and every rank must return an error in time (the binary's watchdog,
//!    and mpirun's `--timeout` behind it, turn a hang into a failure).
//!
//! A step is a [`Step`] variant with a name, a line of help and a function that first
//! installs what it needs and then runs its tests (the `python` step's virtualenv is the
//! pattern). A step that needs a system package — MPI, say — installs it the same way
//! before its tests: check for the tool (`mpirun --version`), `apt-get install -y` the
//! package when it is missing, then run (`mpirun -n 2 …`); add the variant to
//! [`Step::ALL`] in the order it runs.

use std::path::{Path, PathBuf};
use std::process::Command;

use clap::{Args, ValueEnum};

use crate::child::workspace_root;

/// Flags of `cargo xtask test`.
#[derive(Debug, Args)]
pub struct TestArgs {
    /// Steps to leave out, comma-separated.
    #[arg(long, value_delimiter = ',', value_enum)]
    pub skip: Vec<Step>,

    /// The interpreter that creates the virtualenv of the `python` step (Python ≥ 3.9)
    /// [default: $PYTHON, else python3]. An existing virtualenv is reused.
    #[arg(long, value_name = "PATH")]
    pub python: Option<PathBuf>,

    /// Arguments for pytest, after `--` (for instance `-- -k kv_cache -x`).
    #[arg(last = true, value_name = "PYTEST_ARGS")]
    pub pytest_args: Vec<String>,
}

/// One step of `cargo xtask test`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Step {
    /// System packages the build needs (MPI, libclang), installed with apt-get if missing.
    Setup,
    /// `cargo test --workspace`.
    Cargo,
    /// The Python extension's pytest suite, in its own virtualenv.
    Python,
    /// The ring's MPI tests under `mpirun` with 1–4 ranks.
    Mpi,
}

impl Step {
    /// Every step, in the order they run.
    pub const ALL: [Step; 4] = [Step::Setup, Step::Cargo, Step::Python, Step::Mpi];

    fn name(self) -> &'static str {
        match self {
            Step::Setup => "setup",
            Step::Cargo => "cargo",
            Step::Python => "python",
            Step::Mpi => "mpi",
        }
    }

    fn about(self) -> &'static str {
        match self {
            Step::Setup => "system packages: MPI (mpicc, mpirun) and libclang, apt-get if missing",
            Step::Cargo => "cargo test --workspace (the conformance suite on every kernel path)",
            Step::Python => "the Python extension (crates/python): virtualenv, maturin, pytest",
            Step::Mpi => "the ring's MPI tests (attn-ring) under mpirun with 1, 2, 3 and 4 ranks",
        }
    }

    fn run(self, ctx: &Context<'_>) -> Result<(), String> {
        match self {
            Step::Setup => crate::setup::ensure_system_packages(),
            Step::Cargo => cargo_tests(ctx),
            Step::Python => python_tests(ctx),
            Step::Mpi => mpi_tests(ctx),
        }
    }
}

/// What every step sees.
struct Context<'a> {
    root: PathBuf,
    target: PathBuf,
    args: &'a TestArgs,
}

/// Runs the steps that `args` does not skip, in order; the first failure ends the run.
pub fn run(args: &TestArgs) -> Result<(), String> {
    let root = workspace_root();
    let ctx = Context {
        target: target_dir(&root),
        root,
        args,
    };
    let steps: Vec<Step> = Step::ALL
        .into_iter()
        .filter(|s| !args.skip.contains(s))
        .collect();
    for (i, step) in steps.iter().enumerate() {
        println!(
            "xtask test: step {}/{} `{}`: {}",
            i + 1,
            steps.len(),
            step.name(),
            step.about()
        );
        let start = std::time::Instant::now();
        step.run(&ctx)
            .map_err(|e| format!("step `{}` failed: {e}", step.name()))?;
        println!(
            "xtask test: step `{}` took {}",
            step.name(),
            minutes_seconds(start.elapsed())
        );
    }
    Ok(())
}

/// `3 min 07 s`, or `42 s` under a minute.
fn minutes_seconds(d: std::time::Duration) -> String {
    let s = d.as_secs();
    if s < 60 {
        format!("{s} s")
    } else {
        format!("{} min {:02} s", s / 60, s % 60)
    }
}

/// The target directory: `$CARGO_TARGET_DIR` (relative to the workspace root) or
/// `target/`.
fn target_dir(root: &Path) -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => root.join(dir),
        None => root.join("target"),
    }
}

/// The cargo that runs us (`cargo xtask` sets `CARGO`), or the one on the path.
fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

/// Runs `cmd`, its output going to the terminal; `Ok(exit code)` once it has run.
fn status(cmd: &mut Command) -> Result<i32, String> {
    let what = format!("{cmd:?}");
    let status = cmd
        .status()
        .map_err(|e| format!("cannot run {what}: {e}"))?;
    Ok(status.code().unwrap_or(-1))
}

/// Runs `cmd` and fails unless it exits 0.
fn checked(cmd: &mut Command, what: &str) -> Result<(), String> {
    match status(cmd)? {
        0 => Ok(()),
        code => Err(format!("{what} failed (exit status {code})")),
    }
}

fn cargo_tests(ctx: &Context<'_>) -> Result<(), String> {
    checked(
        Command::new(cargo())
            .current_dir(&ctx.root)
            .args(["test", "--workspace"]),
        "cargo test --workspace",
    )
}

/// The ranks the `mpi` step runs the ring's tests with.
const MPI_RANKS: [usize; 4] = [1, 2, 3, 4];

fn mpi_tests(ctx: &Context<'_>) -> Result<(), String> {
    let exe = build_test_binary(ctx, "attn-ring", "ring_mpi")?;
    let root = crate::setup::is_root();
    for ranks in MPI_RANKS {
        println!("xtask test: mpirun -np {ranks} {}", exe.display());
        checked(
            Command::new("mpirun")
                .current_dir(&ctx.root)
                .args(mpirun_args(ranks, root))
                .arg(&exe),
            &format!("the ring's MPI tests with {ranks} ranks"),
        )?;
    }
    let faults = build_fault_tests(ctx)?;
    for ranks in FAULT_RANKS {
        println!("xtask test: mpirun -np {ranks} {}", faults.display());
        checked(
            Command::new("mpirun")
                .current_dir(&ctx.root)
                .args(mpirun_args(ranks, root))
                .arg(&faults),
            &format!("the ring's fault tests with {ranks} ranks"),
        )?;
    }
    Ok(())
}

/// The ranks the fault tests run with: a failure matters when another rank waits for it.
const FAULT_RANKS: [usize; 3] = [2, 3, 4];

/// Builds `attn-ring`'s `ring_faults` test with the test-only `fault-injection` feature and
/// returns its executable. Selected from the whole workspace, so that every dependency keeps
/// the features of the `cargo` step's build: attn-ring alone is compiled again.
fn build_fault_tests(ctx: &Context<'_>) -> Result<PathBuf, String> {
    let output = Command::new(cargo())
        .current_dir(&ctx.root)
        .args([
            "test",
            "--workspace",
            "--features",
            "attn-ring/fault-injection",
        ])
        .args(["--test", "ring_faults", "--no-run"])
        .args(["--message-format", "json-render-diagnostics"])
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !output.status.success() {
        return Err("building the attn-ring test `ring_faults` failed".into());
    }
    test_executable(&String::from_utf8_lossy(&output.stdout), "ring_faults")
        .ok_or_else(|| "cargo built no executable for the attn-ring test `ring_faults`".into())
}

/// `mpirun`'s arguments before the program: on one machine, any number of ranks, threads
/// free to use every core, killed if a case hangs.
fn mpirun_args(ranks: usize, root: bool) -> Vec<String> {
    let mut args: Vec<String> = ["--oversubscribe", "--bind-to", "none", "--timeout", "600"]
        .map(String::from)
        .to_vec();
    if root {
        args.push("--allow-run-as-root".into());
    }
    args.extend(["-np".into(), ranks.to_string()]);
    args
}

/// Builds the workspace's tests (`cargo test --workspace --no-run`: the `cargo` step's very
/// build, so nothing is compiled again with other features) and returns the executable of
/// test target `test`, read from cargo's JSON messages.
fn build_test_binary(ctx: &Context<'_>, package: &str, test: &str) -> Result<PathBuf, String> {
    let output = Command::new(cargo())
        .current_dir(&ctx.root)
        .args(["test", "--workspace", "--no-run"])
        .args(["--message-format", "json-render-diagnostics"])
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !output.status.success() {
        return Err(format!("building the {package} test `{test}` failed"));
    }
    test_executable(&String::from_utf8_lossy(&output.stdout), test)
        .ok_or_else(|| format!("cargo built no executable for the {package} test `{test}`"))
}

/// The executable of test target `test` among cargo's JSON messages.
fn test_executable(messages: &str, test: &str) -> Option<PathBuf> {
    messages.lines().find_map(|line| {
        let m: serde_json::Value = serde_json::from_str(line).ok()?;
        if m["reason"] != "compiler-artifact" || m["target"]["name"] != test {
            return None;
        }
        m["executable"].as_str().map(PathBuf::from)
    })
}

/// The virtualenv's own interpreter.
fn venv_python(venv: &Path) -> PathBuf {
    if cfg!(windows) {
        venv.join("Scripts").join("python.exe")
    } else {
        venv.join("bin").join("python")
    }
}

/// Set to `1` for the pytest suite by the `python` step, which installs everything the suite
/// needs (torch and transformers included): the suite then imports torch without
/// `importorskip` and fails any test that skips (`crates/python/tests/conftest.py`).
pub const NO_SKIP_ENV: &str = "ATTN_TEST_NO_SKIP";

fn python_tests(ctx: &Context<'_>) -> Result<(), String> {
    let crate_dir = ctx.root.join("crates").join("python");
    let venv = ctx.target.join("python-venv");
    let python = venv_python(&venv);
    if !python.exists() {
        create_venv(ctx, &venv)?;
    }
    install_requirements(
        &python,
        &venv,
        &ctx.target.join("python-wheels"),
        &crate_dir.join("requirements-test.txt"),
    )?;
    ensure_inductor_toolchain(&python)?;
    let bin = python
        .parent()
        .expect("the interpreter is in bin/")
        .to_path_buf();
    let path = std::env::join_paths(std::iter::once(bin.clone()).chain(
        std::env::var_os("PATH").map_or_else(Vec::new, |p| std::env::split_paths(&p).collect()),
    ))
    .map_err(|e| format!("cannot extend PATH with {}: {e}", bin.display()))?;
    // maturin installs into the virtualenv named by VIRTUAL_ENV, as `activate` would set it.
    checked(
        Command::new(&python)
            .current_dir(&crate_dir)
            .env("VIRTUAL_ENV", &venv)
            .env("PATH", &path)
            .args(["-m", "maturin", "develop", "--release"]),
        "building the extension (maturin develop --release)",
    )?;
    let code = status(
        Command::new(&python)
            .current_dir(&ctx.root)
            .env("VIRTUAL_ENV", &venv)
            .env("PATH", &path)
            .env(NO_SKIP_ENV, "1")
            .args(["-m", "pytest", "crates/python/tests", "-rs"])
            .args(&ctx.args.pytest_args),
    )?;
    pytest_outcome(code)
}

/// What `torch.compile`'s default backend (inductor) needs on the CPU, for the suite's
/// compile tests (`crates/python/tests/test_torch_compile.py`): a C++ compiler (`$CXX`,
/// else `g++`) and the headers of the virtualenv's Python (`Python.h` in its
/// `sysconfig` include directory). When one is missing it is installed like the `setup`
/// step's packages: `apt-get update`, `apt-get install -y g++` / `python3-dev` (as root,
/// non-interactive); without apt-get or root, the step fails and names the command.
fn ensure_inductor_toolchain(python: &Path) -> Result<(), String> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let mut missing: Vec<&str> = Vec::new();
    if !quiet_success(Command::new(&cxx).arg("--version")) {
        missing.push("g++");
    }
    if !python_headers_present(python) {
        missing.push("python3-dev");
    }
    if missing.is_empty() {
        return Ok(());
    }
    let by_hand = format!("apt-get install -y {}", missing.join(" "));
    if !quiet_success(Command::new("apt-get").arg("--version")) {
        return Err(format!(
            "torch.compile (inductor) needs a C++ compiler and Python's headers; apt-get is not available here: install them by hand ({by_hand} on Debian)"
        ));
    }
    if !crate::setup::is_root() {
        return Err(format!(
            "torch.compile (inductor) needs a C++ compiler and Python's headers; installing them needs root: run `{by_hand}` as root"
        ));
    }
    println!("xtask test: for torch.compile's C++ backend: apt-get update; {by_hand}");
    let mut install = vec!["install", "-y", "-q"];
    install.extend(&missing);
    for args in [vec!["update", "-q"], install] {
        checked(
            Command::new("apt-get")
                .args(&args)
                .env("DEBIAN_FRONTEND", "noninteractive")
                .stdin(std::process::Stdio::null()),
            &format!("apt-get {}", args.join(" ")),
        )?;
    }
    if !quiet_success(Command::new(&cxx).arg("--version")) {
        return Err(format!("{cxx} is still missing after apt-get install"));
    }
    if !python_headers_present(python) {
        return Err(format!(
            "Python.h of {} is still missing after apt-get install python3-dev (an interpreter not from Debian brings its own headers: reinstall it with them)",
            python.display()
        ));
    }
    Ok(())
}

/// Whether `cmd` runs and exits 0, its output discarded.
fn quiet_success(cmd: &mut Command) -> bool {
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether `Python.h` is in the interpreter's include directory.
fn python_headers_present(python: &Path) -> bool {
    quiet_success(Command::new(python).args([
        "-c",
        "import os, sys, sysconfig; sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')) else 1)",
    ]))
}

/// pytest's exit status as a result: 5 ("no tests collected") fails too.
fn pytest_outcome(code: i32) -> Result<(), String> {
    match code {
        0 => Ok(()),
        5 => Err(
            "pytest collected no tests (exit status 5): the Python tests did not run; check crates/python/tests and any pytest arguments given after `--`"
                .into(),
        ),
        1 => Err("pytest: some tests failed (exit status 1)".into()),
        code => Err(format!(
            "pytest did not complete (exit status {code}: interrupted, internal or usage error)"
        )),
    }
}

fn create_venv(ctx: &Context<'_>, venv: &Path) -> Result<(), String> {
    let base: PathBuf = ctx
        .args
        .python
        .clone()
        .or_else(|| std::env::var_os("PYTHON").map(PathBuf::from))
        .unwrap_or_else(|| "python3".into());
    let version_ok = status(Command::new(&base).args([
        "-c",
        "import sys; sys.exit(0 if sys.version_info >= (3, 9) else 3)",
    ]))
    .map_err(|e| format!("{e} (install Python ≥ 3.9, or name one with --python)"))?;
    if version_ok != 0 {
        return Err(format!(
            "{} is not Python ≥ 3.9 (name another with --python)",
            base.display()
        ));
    }
    println!("xtask test: creating the virtualenv {}", venv.display());
    checked(
        Command::new(&base).arg("-m").arg("venv").arg(venv),
        &format!(
            "creating a virtualenv with {} (on Debian, the venv module is apt-get install python3-venv)",
            base.display()
        ),
    )
}

/// Installs the requirements unless the virtualenv already has this very list (its
/// requirement lines, `attn-requirements.txt`, are written after a successful install; a
/// change to the file's comments alone installs nothing). The install reads the wheel cache
/// `wheels` alone (`--no-index`), filled first by [`fill_wheel_cache`].
fn install_requirements(
    python: &Path,
    venv: &Path,
    wheels: &Path,
    requirements: &Path,
) -> Result<(), String> {
    let wanted = requirement_lines(
        &std::fs::read_to_string(requirements)
            .map_err(|e| format!("cannot read {}: {e}", requirements.display()))?,
    );
    let stamp = venv.join("attn-requirements.txt");
    if std::fs::read_to_string(&stamp).is_ok_and(|have| have == wanted) {
        return Ok(());
    }
    fill_wheel_cache(python, wheels, requirements, &wanted)?;
    println!(
        "xtask test: installing {} from the wheel cache {}",
        requirements.display(),
        wheels.display()
    );
    checked(
        Command::new(python).args(pip_install_args(wheels, requirements)),
        &format!(
            "pip install --no-index -r {} (from {})",
            requirements.display(),
            wheels.display()
        ),
    )?;
    std::fs::write(&stamp, wanted).map_err(|e| format!("cannot write {}: {e}", stamp.display()))
}

/// Downloads the wheels of the requirements and of everything they depend on into `wheels`,
/// unless the cache already holds them for this very list and this interpreter (its stamp,
/// `attn-requirements.txt`, is written after a complete download). A changed list downloads
/// only what the cache lacks: `pip download` keeps the files it finds in place. pip's own
/// cache is left out (`--no-cache-dir`), so that the gigabytes of torch are stored once.
fn fill_wheel_cache(
    python: &Path,
    wheels: &Path,
    requirements: &Path,
    wanted: &str,
) -> Result<(), String> {
    let key = wheel_cache_key(wanted, &interpreter_tag(python)?);
    let stamp = wheels.join("attn-requirements.txt");
    if std::fs::read_to_string(&stamp).is_ok_and(|have| have == key) {
        return Ok(());
    }
    std::fs::create_dir_all(wheels)
        .map_err(|e| format!("cannot create {}: {e}", wheels.display()))?;
    println!(
        "xtask test: downloading the wheels of {} into {} (torch: about 3 GB, once per machine)",
        requirements.display(),
        wheels.display()
    );
    checked(
        Command::new(python).args(pip_download_args(wheels, requirements)),
        &format!("pip download -r {}", requirements.display()),
    )?;
    std::fs::write(&stamp, key).map_err(|e| format!("cannot write {}: {e}", stamp.display()))
}

/// The requirements of a requirements file, without its comments and blank lines: what
/// the stamps of the virtualenv and of the wheel cache compare.
fn requirement_lines(text: &str) -> String {
    text.lines()
        .map(|line| line.split(" #").next().unwrap_or_default().trim())
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(|line| format!("{line}\n"))
        .collect()
}

/// What the wheel cache's stamp records: the requirements and the interpreter the wheels
/// were chosen for (a virtualenv of another Python version needs other wheels).
fn wheel_cache_key(requirements: &str, interpreter: &str) -> String {
    format!("{requirements}\n# wheels for: {interpreter}\n")
}

/// The interpreter's implementation, version and platform, as the wheels' tags depend on
/// them (`cpython-311 linux-x86_64`).
fn interpreter_tag(python: &Path) -> Result<String, String> {
    let output = Command::new(python)
        .args([
            "-c",
            "import sys, sysconfig; print(sys.implementation.cache_tag, sysconfig.get_platform())",
        ])
        .output()
        .map_err(|e| format!("cannot run {}: {e}", python.display()))?;
    if !output.status.success() {
        return Err(format!(
            "{} could not name its version and platform",
            python.display()
        ));
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// `python -m pip download …`: the requirements and their dependencies as files in `wheels`.
fn pip_download_args(wheels: &Path, requirements: &Path) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = [
        "-m",
        "pip",
        "download",
        "--disable-pip-version-check",
        "--no-cache-dir",
        "--progress-bar",
        "off",
        "--dest",
    ]
    .map(Into::into)
    .to_vec();
    args.push(wheels.into());
    args.push("-r".into());
    args.push(requirements.into());
    args
}

/// `python -m pip install …` from the wheel cache alone: no index, so no download.
fn pip_install_args(wheels: &Path, requirements: &Path) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = [
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--no-index",
        "--find-links",
    ]
    .map(Into::into)
    .to_vec();
    args.push(wheels.into());
    args.push("-r".into());
    args.push(requirements.into());
    args
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        test: TestArgs,
    }

    fn parse(args: &[&str]) -> Result<TestArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("test").chain(args.iter().copied())).map(|c| c.test)
    }

    #[test]
    fn flags_parse() {
        let a = parse(&[]).unwrap();
        assert!(a.skip.is_empty() && a.python.is_none() && a.pytest_args.is_empty());
        let a = parse(&[
            "--skip",
            "cargo",
            "--python",
            "/usr/bin/python3.11",
            "--",
            "-k",
            "kv",
            "-x",
        ])
        .unwrap();
        assert_eq!(a.skip, [Step::Cargo]);
        assert_eq!(a.python.as_deref(), Some(Path::new("/usr/bin/python3.11")));
        assert_eq!(a.pytest_args, ["-k", "kv", "-x"]);
        assert_eq!(
            parse(&["--skip", "setup,cargo,python,mpi"]).unwrap().skip,
            Step::ALL
        );
        assert!(parse(&["--skip", "ring"]).is_err());
    }

    #[test]
    fn steps_are_named_as_the_flag_spells_them() {
        for step in Step::ALL {
            let value = step.to_possible_value().expect("every step is a value");
            assert_eq!(value.get_name(), step.name());
        }
    }

    #[test]
    fn setup_runs_first_and_mpi_last() {
        assert_eq!(Step::ALL.first(), Some(&Step::Setup));
        assert_eq!(Step::ALL.last(), Some(&Step::Mpi));
    }

    #[test]
    fn mpirun_runs_any_number_of_ranks_unpinned() {
        let a = mpirun_args(3, false);
        assert!(a.contains(&"--oversubscribe".into()));
        assert!(!a.contains(&"--allow-run-as-root".into()));
        assert_eq!(&a[a.len() - 2..], ["-np", "3"]);
        assert!(mpirun_args(1, true).contains(&"--allow-run-as-root".into()));
    }

    #[test]
    fn the_test_executable_is_read_from_cargo_messages() {
        let messages = concat!(
            r#"{"reason":"compiler-artifact","target":{"name":"attn_ring"},"executable":null}"#,
            "\n",
            r#"{"reason":"compiler-artifact","target":{"name":"ring_mpi"},"executable":"/t/ring_mpi-1"}"#,
            "\n",
            r#"{"reason":"build-finished","success":true}"#,
        );
        assert_eq!(
            test_executable(messages, "ring_mpi"),
            Some(PathBuf::from("/t/ring_mpi-1"))
        );
        assert_eq!(test_executable(messages, "other"), None);
    }

    #[test]
    fn pytest_exit_statuses() {
        assert!(pytest_outcome(0).is_ok());
        assert!(pytest_outcome(1).unwrap_err().contains("some tests failed"));
        assert!(
            pytest_outcome(5)
                .unwrap_err()
                .contains("collected no tests")
        );
        assert!(pytest_outcome(2).unwrap_err().contains("did not complete"));
    }

    #[test]
    fn the_install_reads_the_wheel_cache_alone() {
        let (wheels, req) = (Path::new("/t/python-wheels"), Path::new("/r/req.txt"));
        let install = pip_install_args(wheels, req);
        assert!(install.iter().any(|a| a == "--no-index"));
        let at = install.iter().position(|a| a == "--find-links").unwrap();
        assert_eq!(install[at + 1], wheels.as_os_str());
        assert_eq!(install.last().map(|a| a.as_os_str()), Some(req.as_os_str()));
        let download = pip_download_args(wheels, req);
        assert!(download.iter().any(|a| a == "download"));
        let at = download.iter().position(|a| a == "--dest").unwrap();
        assert_eq!(download[at + 1], wheels.as_os_str());
        assert!(download.iter().any(|a| a == "--no-cache-dir"));
    }

    #[test]
    fn the_wheel_cache_is_keyed_by_requirements_and_interpreter() {
        let a = wheel_cache_key("torch==2.15.0\n", "cpython-311 linux-x86_64");
        assert_ne!(
            a,
            wheel_cache_key("torch==2.15.1\n", "cpython-311 linux-x86_64")
        );
        assert_ne!(
            a,
            wheel_cache_key("torch==2.15.0\n", "cpython-312 linux-x86_64")
        );
        assert_eq!(
            a,
            wheel_cache_key("torch==2.15.0\n", "cpython-311 linux-x86_64")
        );
    }

    #[test]
    fn durations_read_as_minutes_and_seconds() {
        use std::time::Duration;
        assert_eq!(minutes_seconds(Duration::from_millis(42_900)), "42 s");
        assert_eq!(minutes_seconds(Duration::from_secs(187)), "3 min 07 s");
    }

    #[test]
    fn the_stamps_compare_requirements_not_comments() {
        let a = requirement_lines("# torch, pinned\nnumpy>=1.22\n\ntorch==2.15.0  # CUDA\n");
        assert_eq!(a, "numpy>=1.22\ntorch==2.15.0\n");
        assert_eq!(
            a,
            requirement_lines("# other words\nnumpy>=1.22\ntorch==2.15.0\n")
        );
        assert_ne!(a, requirement_lines("numpy>=1.22\ntorch==2.15.1\n"));
    }

    #[test]
    fn target_dir_follows_cargo() {
        // Only the default: setting CARGO_TARGET_DIR here would race with other tests.
        if std::env::var_os("CARGO_TARGET_DIR").is_none() {
            assert_eq!(target_dir(Path::new("/w")), Path::new("/w/target"));
        }
    }
}
