//! The output bits of the candle op, for bit-for-bit comparisons of two commits:
//! `cargo run -p attn-candle --example bits -- OUT` writes, for a fixed set of
//! cases, the op's outputs and the gradients candle's autograd gets through it, in the
//! format of `cargo xtask bits` (`benches/src/bin/bits.rs`): per case a header line
//! `name count fnv64` and the elements' bits as little-endian `u32`s. Run it in a worktree
//! of each commit, on the same CPU, and `cmp` the files.
//!
//! The cases cover forward (tracked, which keeps the LSE, and untracked) and backward,
//! shared and per-(batch, head) masks (boolean allow and block, additive in f32 and half),
//! key lengths, windows, grouped-query heads, f32/f16/bf16, both input layouts and both
//! output layouts. Cases of calls a commit lacks (packed batches) come after all others.

use std::io::Write;

use attn_candle::candle_core::{DType, Device, Result, Tensor, Var};
use attn_candle::{AttentionOptions, Causal, Layout, SlidingWindow, scaled_dot_product_attention};

/// A fixed generator of inputs (splitmix64), values in `[-2, 2)`: the one of `attn-bits`.
struct Gen(u64);
impl Gen {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
    }
    fn tensor(&mut self, dims: &[usize]) -> Result<Tensor> {
        let n = dims.iter().product();
        let v: Vec<f32> = (0..n).map(|_| self.next()).collect();
        Tensor::from_vec(v, dims, &Device::Cpu)
    }
}

fn fnv(bits: &[u32]) -> u64 {
    bits.iter()
        .flat_map(|b| b.to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325, |h, byte| {
            (h ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
        })
}

/// A tensor's elements' bits, widened to `u32`, in its logical row-major order.
fn bits(t: &Tensor) -> Result<Vec<u32>> {
    let t = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 => t.to_vec1::<f32>()?.iter().map(|x| x.to_bits()).collect(),
        DType::F16 => t
            .to_vec1::<half::f16>()?
            .iter()
            .map(|x| u32::from(x.to_bits()))
            .collect(),
        DType::BF16 => t
            .to_vec1::<half::bf16>()?
            .iter()
            .map(|x| u32::from(x.to_bits()))
            .collect(),
        other => return Err(attn_candle::Error::Msg(format!("no bits of {other:?}"))),
    })
}

#[derive(Default)]
struct Bits(Vec<(String, Vec<u32>)>);

impl Bits {
    fn push(&mut self, name: String, results: &[&Tensor]) -> Result<()> {
        let mut all = Vec::new();
        for t in results {
            all.extend(bits(t)?);
        }
        self.0.push((name, all));
        Ok(())
    }

    fn write(&self, path: &str) -> std::io::Result<()> {
        let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
        for (name, bits) in &self.0 {
            writeln!(out, "{name} {} {:016x}", bits.len(), fnv(bits))?;
            for b in bits {
                out.write_all(&b.to_le_bytes())?;
            }
        }
        out.flush()
    }
}

/// The gradients of `Σ o ∘ w` (in f32) with respect to the leaves `vars`.
fn gradients(o: &Tensor, w: &Tensor, vars: [&Var; 3]) -> Result<[Tensor; 3]> {
    let grads = (o.to_dtype(DType::F32)? * w.to_dtype(DType::F32)?)?
        .sum_all()?
        .backward()?;
    let grad = |x: &Var| {
        grads
            .get(x)
            .cloned()
            .ok_or_else(|| attn_candle::Error::Msg("no gradient".into()))
    };
    Ok([grad(vars[0])?, grad(vars[1])?, grad(vars[2])?])
}

fn main() -> Result<()> {
    let path = std::env::args()
        .nth(1)
        .ok_or_else(|| attn_candle::Error::Msg("usage: bits OUT".into()))?;
    let mut g = Gen(11);
    let mut out = Bits::default();
    let (b, h, hkv, l, s, d) = (2, 4, 2, 9, 13, 16);
    let q = g.tensor(&[b, h, l, d])?;
    let k = g.tensor(&[b, hkv, s, d])?;
    let v = g.tensor(&[b, hkv, s, d])?;
    let k_full = g.tensor(&[b, h, s, d])?;
    let v_full = g.tensor(&[b, h, s, d])?;
    let w = g.tensor(&[b, h, l, d])?;
    let shared = g.tensor(&[l, s])?.ge(-1.0)?;
    let per_head = g.tensor(&[b, h, l, s])?.ge(-1.0)?;
    let per_batch = g.tensor(&[b, 1, l, s])?.ge(-0.5)?;
    let additive = (g.tensor(&[h, l, s])? * 0.5)?;
    let masks: Vec<(&str, AttentionOptions)> = vec![
        ("none", AttentionOptions::default()),
        (
            "causal",
            AttentionOptions::default().with_causal(Causal::TopLeft),
        ),
        (
            "window",
            AttentionOptions::default()
                .with_causal(Causal::BottomRight)
                .with_window(SlidingWindow::new(Some(4), Some(0), Causal::BottomRight)),
        ),
        (
            "lengths",
            AttentionOptions::default().with_key_lengths(vec![13, 6]),
        ),
        (
            "allow",
            AttentionOptions::default().with_allow_mask(shared.clone()),
        ),
        (
            "allow_bh",
            AttentionOptions::default().with_allow_mask(per_head.clone()),
        ),
        (
            "block_b",
            AttentionOptions::default().with_block_mask(per_batch.clone()),
        ),
        (
            "add_h",
            AttentionOptions::default().with_additive_mask(additive.clone()),
        ),
        (
            "add_h_bf16",
            AttentionOptions::default().with_additive_mask(additive.to_dtype(DType::BF16)?),
        ),
    ];
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let dt = dtype.as_str();
        let (q, k, v) = (q.to_dtype(dtype)?, k.to_dtype(dtype)?, v.to_dtype(dtype)?);
        let (kf, vf) = (k_full.to_dtype(dtype)?, v_full.to_dtype(dtype)?);
        let w = w.to_dtype(dtype)?;
        for (mname, opts) in &masks {
            for (gqa, kk, vv) in [("gqa", &k, &v), ("mha", &kf, &vf)] {
                for layout in [Layout::Bhsd, Layout::Bshd] {
                    let lname = format!("{layout:?}").to_lowercase();
                    let tag = format!("{dt}/{mname}/{gqa}/{lname}");
                    let opts = opts.clone().with_output_layout(layout);
                    // Untracked: no LSE computed.
                    let o = scaled_dot_product_attention(&q, kk, vv, &opts)?;
                    out.push(format!("candle/forward/{tag}"), &[&o])?;
                    // Tracked: the op keeps the LSE, and the backward reads it.
                    let (xq, xk, xv) = (
                        Var::from_tensor(&q)?,
                        Var::from_tensor(kk)?,
                        Var::from_tensor(vv)?,
                    );
                    let o = scaled_dot_product_attention(&xq, &xk, &xv, &opts)?;
                    let wl = match layout {
                        Layout::Bhsd => w.clone(),
                        Layout::Bshd => w.transpose(1, 2)?.contiguous()?,
                    };
                    let [gq, gk, gv] = gradients(&o, &wl, [&xq, &xk, &xv])?;
                    out.push(format!("candle/backward/{tag}"), &[&o, &gq, &gk, &gv])?;
                }
            }
        }
        // [B, S, H, D] leaves seen through transposes.
        let leaf =
            |t: &Tensor| -> Result<Var> { Var::from_tensor(&t.transpose(1, 2)?.contiguous()?) };
        let (xq, xk, xv) = (leaf(&q)?, leaf(&k)?, leaf(&v)?);
        let opts = AttentionOptions::default()
            .with_causal(Causal::BottomRight)
            .with_allow_mask(per_head.clone());
        let o = scaled_dot_product_attention(
            &xq.transpose(1, 2)?,
            &xk.transpose(1, 2)?,
            &xv.transpose(1, 2)?,
            &opts.with_output_layout(Layout::Bshd),
        )?;
        let [gq, gk, gv] = gradients(&o, &w.transpose(1, 2)?, [&xq, &xk, &xv])?;
        out.push(format!("candle/bshd_leaves/{dt}"), &[&o, &gq, &gk, &gv])?;
    }
    out.write(&path)
        .map_err(|e| attn_candle::Error::Msg(format!("cannot write {path}: {e}")))?;
    println!("{} cases written to {path}", out.0.len());
    Ok(())
}
