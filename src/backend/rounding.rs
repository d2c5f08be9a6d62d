//! Rounding an f32 master weight into its 16-bit working copy: round to nearest, or
//! stochastic rounding for bf16 (llm.c's scheme: round up with probability equal to the
//! discarded fraction, so `E[SR(x)] = x` and updates smaller than half an ulp still move the
//! weight on average).
//!
//! The random bits are Philox 4x32-10 of (element index / 8) under a key derived from a seed
//! and the step count, so a kernel on any device, chunked any way, draws the same bits, and a
//! working copy can be regenerated from its master bit-exactly (after a checkpoint load).

use crate::random::philox;
use half::bf16;

/// How an f32 master is rounded into its f16/bf16 working copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Rounding {
    /// Round to nearest even (what a plain cast does).
    #[default]
    Nearest,
    /// Stochastic rounding (bf16 working copies only), seeded: the same seed, parameter and
    /// step give the same bits.
    Stochastic { seed: u64 },
}

/// The Philox key of one update: `seed` (already mixed with the parameter's index) and the
/// number of updates taken before this one.
pub fn stochastic_key(seed: u64, steps: u64) -> [u32; 2] {
    let r = philox(
        [steps as u32, (steps >> 32) as u32, 0x5352_4e44, 0],
        [seed as u32, (seed >> 32) as u32],
    );
    [r[0], r[1]]
}

/// Mixes a parameter's index into a seed, so parameters draw independent streams.
pub fn stream_seed(seed: u64, index: usize) -> u64 {
    let r = philox(
        [index as u32, (index as u64 >> 32) as u32, 0x4d53_5452, 0],
        [seed as u32, (seed >> 32) as u32],
    );
    (r[0] as u64) | ((r[1] as u64) << 32)
}

/// Sixteen random bits for each of the elements `8 * block .. 8 * block + 8`.
pub fn stochastic_bits(key: [u32; 2], block: u64) -> [u16; 8] {
    let r = philox([block as u32, (block >> 32) as u32, 0, 0], key);
    std::array::from_fn(|i| (r[i / 2] >> (16 * (i % 2))) as u16)
}

/// Rounds `x` to one of its two neighbouring bf16 values: up (in magnitude) when the 16
/// discarded bits exceed `r`, so with `r` uniform the probability of rounding up is the
/// discarded fraction. Infinities and NaN convert as a plain cast would.
pub fn bf16_stochastic(x: f32, r: u16) -> bf16 {
    if !x.is_finite() {
        return bf16::from_f32(x);
    }
    let bits = x.to_bits();
    let kept = bits & 0xFFFF_0000;
    let up = (bits & 0xFFFF) > r as u32;
    bf16::from_bits(((kept + if up { 0x1_0000 } else { 0 }) >> 16) as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn representable_values_are_kept() {
        for x in [0.0f32, -0.0, 1.0, -2.5, 1.0e-30, 3.0e38] {
            let b = bf16::from_f32(x);
            for r in [0u16, 1, 0x7FFF, 0xFFFF] {
                assert_eq!(bf16_stochastic(b.to_f32(), r).to_bits(), b.to_bits());
            }
        }
    }

    #[test]
    fn rounds_to_a_neighbour_with_the_discarded_fraction() {
        // 1 + 2^-9: a quarter of the way from 1.0 to the next bf16 (1 + 2^-7).
        let x = 1.0f32 + 2f32.powi(-9);
        let (lo, hi) = (1.0f32, 1.0 + 2f32.powi(-7));
        assert_eq!(bf16_stochastic(x, 0x3FFF).to_f32(), hi);
        assert_eq!(bf16_stochastic(x, 0x4000).to_f32(), lo);
        assert_eq!(bf16_stochastic(-x, 0).to_f32(), -hi);
        assert!(bf16_stochastic(f32::NAN, 0).is_nan());
        assert_eq!(bf16_stochastic(f32::INFINITY, 0).to_f32(), f32::INFINITY);
    }

    #[test]
    fn streams_differ_by_seed_step_and_index() {
        let a = stochastic_bits(stochastic_key(1, 0), 0);
        assert_ne!(a, stochastic_bits(stochastic_key(2, 0), 0));
        assert_ne!(a, stochastic_bits(stochastic_key(1, 1), 0));
        assert_ne!(a, stochastic_bits(stochastic_key(1, 0), 1));
        assert_ne!(stream_seed(1, 0), stream_seed(1, 1));
        assert_eq!(a, stochastic_bits(stochastic_key(1, 0), 0));
    }
}
