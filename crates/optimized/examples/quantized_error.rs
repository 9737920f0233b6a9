//! The error each quantized cache format costs, as `docs/accuracy.md` publishes it: the
//! largest row error `‖o − o_ref‖ / ‖o_ref‖` of decode steps (32 heads of 128, 4,096
//! keys, four query draws) against the same call over an f32 cache of the same rows, on
//! standard-normal rows and with outlier key channels (every 29th channel twenty times the
//! others: in spread, or in mean).
//!
//! `cargo run --release -p attn-optimized --example quantized_error`

#[allow(dead_code)]
#[path = "../tests/common/quantized.rs"]
mod quantized;

use quantized::{FORMATS, Outliers, error_against_f32};

fn main() {
    println!(
        "| format | standard normal | outlier channels, spread ×20 | outlier channels, mean ±20 |"
    );
    println!("|---|---|---|---|");
    for format in FORMATS {
        let worst = |outliers: Outliers| {
            (1..=4)
                .map(|seed| error_against_f32(format, (32, 128, 4096), outliers, seed))
                .fold(0.0, f64::max)
        };
        let name = format!(
            "{}{}",
            format.codes.name(),
            if format.key_channels {
                ", per-channel keys"
            } else {
                ", per token"
            }
        );
        println!(
            "| {name} | {:.2e} | {:.2e} | {:.2e} |",
            worst(Outliers::None),
            worst(Outliers::Spread),
            worst(Outliers::Offset)
        );
    }
}
