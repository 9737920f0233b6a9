//! The `setup` step of `cargo xtask test`: the system packages the workspace builds
//! against, installed with apt-get when missing.
//!
//! `attn-ring` links the system MPI: its `mpi-sys` build script asks `mpicc` how to link
//! and runs bindgen, which loads libclang. On a fresh Debian machine neither is there, and
//! `cargo test --workspace` (like `cargo build` or `cargo clippy --workspace`) fails, so this
//! step runs first.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// A system package set and how to tell whether it is installed.
struct Need {
    /// What it provides, for messages.
    what: &'static str,
    /// The Debian packages that provide it.
    packages: &'static [&'static str],
    present: fn() -> bool,
}

const NEEDS: [Need; 2] = [
    Need {
        what: "MPI (mpicc, mpirun)",
        packages: &["libopenmpi-dev", "openmpi-bin"],
        present: mpi_present,
    },
    Need {
        what: "libclang (bindgen)",
        packages: &["libclang-dev"],
        present: libclang_present,
    },
];

/// Checks for every need and installs the missing ones with apt-get.
pub fn ensure_system_packages() -> Result<(), String> {
    let missing: Vec<&Need> = NEEDS.iter().filter(|n| !(n.present)()).collect();
    if missing.is_empty() {
        println!("xtask test: MPI and libclang are installed");
        return Ok(());
    }
    let packages: Vec<&str> = missing
        .iter()
        .flat_map(|n| n.packages.iter().copied())
        .collect();
    let what: Vec<&str> = missing.iter().map(|n| n.what).collect();
    let by_hand = format!("apt-get install -y {}", packages.join(" "));
    if !runs("apt-get", &["--version"]) {
        return Err(format!(
            "missing {}; apt-get is not available here: install them by hand ({by_hand} on Debian)",
            what.join(" and ")
        ));
    }
    if !is_root() {
        return Err(format!(
            "missing {}; installing them needs root: run `{by_hand}` as root",
            what.join(" and ")
        ));
    }
    println!("xtask test: missing {}: apt-get update", what.join(" and "));
    apt(&["update", "-q"])?;
    println!("xtask test: {by_hand}");
    let mut args = vec!["install", "-y", "-q"];
    args.extend(&packages);
    apt(&args)?;
    match NEEDS.iter().find(|n| !(n.present)()) {
        Some(n) => Err(format!("{} is still missing after apt-get install", n.what)),
        None => Ok(()),
    }
}

fn apt(args: &[&str]) -> Result<(), String> {
    let status = Command::new("apt-get")
        .args(args)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdin(Stdio::null())
        .status()
        .map_err(|e| format!("cannot run apt-get: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!(
            "apt-get {} failed (exit status {})",
            args.join(" "),
            status.code().unwrap_or(-1)
        ))
    }
}

/// Whether `program args` runs and exits 0 (its output discarded).
fn runs(program: &str, args: &[&str]) -> bool {
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn mpi_present() -> bool {
    runs("mpicc", &["--version"]) && runs("mpirun", &["--version"])
}

/// Whether this process runs as root (`id -u` is 0).
pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// Where clang-sys looks for libclang: `$LIBCLANG_PATH`, LLVM's directories and the
/// system library directories.
fn libclang_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("LIBCLANG_PATH")
        .map(PathBuf::from)
        .into_iter()
        .collect();
    if let Ok(entries) = std::fs::read_dir("/usr/lib") {
        let mut llvm: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("llvm-"))
            })
            .map(|p| p.join("lib"))
            .collect();
        llvm.sort();
        dirs.extend(llvm);
    }
    dirs.extend(
        [
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu",
            "/usr/lib64",
            "/usr/lib",
        ]
        .map(PathBuf::from),
    );
    dirs
}

/// `libclang.so`, `libclang.so.1`, `libclang-14.so.1`: not `libclang-cpp`, a different
/// library.
fn is_libclang(name: &str) -> bool {
    name.starts_with("libclang")
        && name.contains(".so")
        && !name.starts_with("libclang-cpp")
        && (name.starts_with("libclang.") || name.starts_with("libclang-"))
}

fn libclang_present() -> bool {
    libclang_dirs().iter().any(|d| has_libclang(d))
}

fn has_libclang(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| is_libclang(&e.file_name().to_string_lossy()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libclang_names() {
        for yes in [
            "libclang.so",
            "libclang.so.1",
            "libclang-14.so.1",
            "libclang-16.so",
        ] {
            assert!(is_libclang(yes), "{yes}");
        }
        for no in [
            "libclang-cpp.so.14",
            "libclang.a",
            "libclangBasic.a",
            "libc.so.6",
        ] {
            assert!(!is_libclang(no), "{no}");
        }
    }

    #[test]
    fn every_need_names_its_packages() {
        assert!(NEEDS.iter().all(|n| !n.packages.is_empty()));
        let all: Vec<&str> = NEEDS
            .iter()
            .flat_map(|n| n.packages.iter().copied())
            .collect();
        assert_eq!(all, ["libopenmpi-dev", "openmpi-bin", "libclang-dev"]);
    }
}
