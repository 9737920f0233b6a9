//! Blocked streaming attention with online softmax (FlashAttention-2 style) in f32.
