//! Prints the worked examples step by step: scores, scaled scores, weights, output.
//!
//! `cargo run -p attn-reference --example walkthrough`

use attn_reference::{Attention, Causal, Options, Result, worked};
use faer::{Mat, MatRef};

fn show(name: &str, m: MatRef<'_, f64>) {
    println!("{name}:");
    for i in 0..m.nrows() {
        let row: Vec<String> = (0..m.ncols())
            .map(|j| {
                let x = m[(i, j)];
                if x == f64::NEG_INFINITY {
                    "    -inf".to_string()
                } else {
                    format!("{x:8.4}")
                }
            })
            .collect();
        println!("  [{}]", row.join(", "));
    }
}

fn walk(ex: &worked::Example, options: &Options<'_>, label: &str) -> Result<()> {
    let d_k = ex.q.ncols();
    let scale = options.scale_for_f64(d_k)?;
    println!("== {} ({label}) ==", ex.title);
    let raw = Mat::<f64>::from_fn(ex.q.nrows(), ex.k.nrows(), |i, j| {
        (0..d_k)
            .map(|c| f64::from(ex.q[(i, c)]) * f64::from(ex.k[(j, c)]))
            .sum()
    });
    show("1. scores Q Kᵀ", raw.as_ref());
    let m = Attention::head(ex.q.as_ref(), ex.k.as_ref(), ex.v.as_ref(), options)
        .and_then(|call| call.materialized())?;
    println!("2. scale = 1/√d_k = 1/√{d_k} = {scale:.4}");
    show("3. scaled and masked scores S", m.scores.as_ref());
    show("4. weights A = softmax(S) along keys", m.weights.as_ref());
    show("5. output O = A V", m.output.as_ref());
    println!();
    Ok(())
}

fn main() -> Result<()> {
    let two = worked::two_tokens();
    walk(&two, &Options::default(), "no mask")?;
    walk(
        &two,
        &Options::default().with_causal(Causal::TopLeft),
        "causal",
    )?;
    walk(&worked::three_positions(), &Options::default(), "no mask")?;
    Ok(())
}
