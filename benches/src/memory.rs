//! Resident memory of the current process, from Linux's `/proc/self/status`.
//!
//! The case runner reads it before and after an engine's first run: the growth of the peak
//! resident set (`VmHWM`) over the resident set once the inputs exist (`VmRSS`) is the
//! memory the engine needed. Off Linux every reading is `None` and the report says so.

/// The process's current and peak resident set, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Residency {
    /// `VmRSS`: resident now.
    pub rss_bytes: u64,
    /// `VmHWM`: the peak resident set since the process started or the peak was reset.
    pub peak_bytes: u64,
}

/// Reads `/proc/self/status`; `None` where it does not exist or lacks the fields.
///
/// ```
/// if let Some(r) = attn_benches::memory::residency() {
///     assert!(r.peak_bytes >= r.rss_bytes);
/// }
/// ```
pub fn residency() -> Option<Residency> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_status(&status)
}

/// Extracts `VmRSS` and `VmHWM` (reported in kB) from the text of a `status` file.
///
/// ```
/// use attn_benches::memory::{parse_status, Residency};
/// let text = "Name:\tx\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n";
/// assert_eq!(
///     parse_status(text),
///     Some(Residency { rss_bytes: 1 << 20, peak_bytes: 2 << 20 })
/// );
/// ```
pub fn parse_status(text: &str) -> Option<Residency> {
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let kb: u64 = line[name.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kb * 1024)
    };
    Some(Residency {
        rss_bytes: field("VmRSS:")?,
        peak_bytes: field("VmHWM:")?,
    })
}

/// Resets the peak resident set to the current one (writes `5` to
/// `/proc/self/clear_refs`, Linux ≥ 4.0). Returns whether the kernel accepted it; when it
/// did not, a later peak may still be the one reached while the inputs were built.
///
/// ```
/// let _exact = attn_benches::memory::reset_peak(); // false off Linux or when forbidden
/// ```
pub fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}
