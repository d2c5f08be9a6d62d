//! A seedable counter-based generator (Philox 4x32-10), the same family cuRAND and PyTorch's
//! CUDA generator use, so a later CUDA kernel can draw the same stream from (seed, offset).

use std::cell::RefCell;

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Philox 4x32-10 of counter `ctr` under key `key`.
pub fn philox(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (ctr, key);
    for _ in 0..10 {
        let p0 = (M0 as u64) * (c[0] as u64);
        let p1 = (M1 as u64) * (c[2] as u64);
        c = [
            ((p1 >> 32) as u32) ^ c[1] ^ k[0],
            p1 as u32,
            ((p0 >> 32) as u32) ^ c[3] ^ k[1],
            p0 as u32,
        ];
        k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
    }
    c
}

/// Block `i` of the stream of `seed`: four u32 words.
pub(crate) fn philox_block(seed: u64, i: u64) -> [u32; 4] {
    philox(
        [i as u32, (i >> 32) as u32, 0, 0],
        [seed as u32, (seed >> 32) as u32],
    )
}

/// A draw from U[0, 1) with 53 bits of resolution from two words.
fn unit(hi: u32, lo: u32) -> f64 {
    ((((hi as u64) << 21) ^ (lo as u64 >> 11)) & ((1 << 53) - 1)) as f64 * 2f64.powi(-53)
}

/// The two N(0, 1) draws of one block (Box-Muller of its two uniforms): the definition the
/// host and `cuda/random.cu` share.
pub(crate) fn box_muller(w: [u32; 4]) -> [f64; 2] {
    let (u0, u1) = (unit(w[0], w[1]), unit(w[2], w[3]));
    let r = (-2.0 * (1.0 - u0).ln()).sqrt();
    let t = 2.0 * std::f64::consts::PI * u1;
    [r * t.cos(), r * t.sin()]
}

/// A random generator: a 64-bit seed and a position in its stream.
///
/// ```
/// use mantissa::Generator;
/// let mut a = Generator::new(7);
/// let mut b = Generator::new(7);
/// assert_eq!(a.uniform(4), b.uniform(4));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generator {
    seed: u64,
    /// Number of 128-bit blocks consumed.
    offset: u64,
}

impl Generator {
    pub fn new(seed: u64) -> Generator {
        Generator { seed, offset: 0 }
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Blocks of four u32 consumed so far (the CUDA kernels start from here).
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The generator at block `offset` of `seed`'s stream (a state [`Generator::offset`]
    /// reported, say). Every offset is a valid state: the block counter runs modulo 2^64.
    pub fn at(seed: u64, offset: u64) -> Generator {
        Generator { seed, offset }
    }

    /// Reserves `blocks` blocks of the stream and returns the first one's index. The block
    /// counter runs modulo 2^64, as Philox's counter does: past block 2^64 - 1 the stream
    /// goes on from block 0.
    fn reserve(&mut self, blocks: u64) -> u64 {
        let start = self.offset;
        self.offset = self.offset.wrapping_add(blocks);
        start
    }

    /// The `(seed, first block)` of `blocks` blocks of the stream for a kernel that draws
    /// them itself (in parallel, or on a device), advancing the generator past them. Inside
    /// a gradient checkpoint's recomputation the stream its forward drew is returned instead
    /// and the generator stays where it is.
    pub(crate) fn stream(&mut self, blocks: u64) -> (u64, u64) {
        let seed = self.seed;
        crate::frames::draw(seed, blocks, || self.reserve(blocks))
    }

    /// `n` u32 words, advancing the stream.
    pub fn next_u32s(&mut self, n: usize) -> Vec<u32> {
        let (seed, start) = self.stream(n.div_ceil(4) as u64);
        blocks_from(start)
            .flat_map(|b| philox_block(seed, b))
            .take(n)
            .collect()
    }

    /// `n` draws from U[0, 1) with 53 bits of resolution, two words each.
    pub fn uniform(&mut self, n: usize) -> Vec<f64> {
        let w = self.next_u32s(2 * n);
        w.chunks_exact(2).map(|p| unit(p[0], p[1])).collect()
    }

    /// `n` draws from N(0, 1) (Box-Muller), a pair from each block.
    pub fn normal(&mut self, n: usize) -> Vec<f64> {
        let (seed, start) = self.stream(n.div_ceil(2) as u64);
        blocks_from(start)
            .flat_map(|b| box_muller(philox_block(seed, b)))
            .take(n)
            .collect()
    }
}

/// `n` draws from U[0, 1) from block `start` of `seed`'s stream on, as
/// [`Generator::uniform`] draws them (two words each), made as they are read.
pub(crate) fn uniform_values((seed, start): (u64, u64), n: usize) -> impl Iterator<Item = f64> {
    let mut words = blocks_from(start).flat_map(move |b| philox_block(seed, b));
    (0..n).map(move |_| {
        // The words never run out: the blocks go on for ever.
        let (hi, lo) = (words.next().unwrap_or(0), words.next().unwrap_or(0));
        unit(hi, lo)
    })
}

/// The block indices of a stream from `start` on, modulo 2^64.
fn blocks_from(start: u64) -> impl Iterator<Item = u64> {
    (0u64..).map(move |i| start.wrapping_add(i))
}

thread_local! {
    static DEFAULT: RefCell<Generator> = RefCell::new(Generator::new(0x5EED));
}

/// Seeds this thread's default generator (like `torch.manual_seed`).
pub fn manual_seed(seed: u64) {
    DEFAULT.with(|g| *g.borrow_mut() = Generator::new(seed));
}

/// Runs `f` with this thread's default generator.
///
/// `f` gets the generator itself, not a borrow held on the thread: while it runs (say it
/// starts a CPU kernel, and the thread picks up another rayon task that draws from the
/// default generator meanwhile), the thread's default generator stands where `f` found it,
/// and `f`'s draws are added to it when `f` returns. Draws made meanwhile come from the same
/// blocks as `f`'s; the engine's own draws never run anything while holding it.
pub fn with_default_generator<R>(f: impl FnOnce(&mut Generator) -> R) -> R {
    let mut g = DEFAULT.with(|d| d.borrow().clone());
    let before = g.offset;
    let r = f(&mut g);
    let used = g.offset.wrapping_sub(before);
    DEFAULT.with(|d| {
        let mut d = d.borrow_mut();
        if d.seed == g.seed {
            d.offset = d.offset.wrapping_add(used);
        } else {
            // `f` replaced the generator (a new seed): its state is the thread's now.
            *d = g;
        }
    });
    r
}

/// The `(seed, first block)` of `blocks` blocks of this thread's default generator's stream,
/// reserved under a borrow that ends before anything else runs.
pub(crate) fn default_stream(blocks: u64) -> (u64, u64) {
    let seed = DEFAULT.with(|d| d.borrow().seed);
    let (seed, start) = crate::frames::draw(seed, blocks, || {
        DEFAULT.with(|d| d.borrow_mut().reserve(blocks))
    });
    crate::capture::draw(|| Box::new(DefaultGenerator), seed, start);
    (seed, start)
}

/// This thread's default generator, for a CUDA graph's replay to read and advance.
struct DefaultGenerator;

impl crate::capture::GenState for DefaultGenerator {
    fn state(&self) -> crate::Result<(u64, u64)> {
        Ok(DEFAULT.with(|d| {
            let d = d.borrow();
            (d.seed, d.offset)
        }))
    }

    fn set_state(&self, (seed, offset): (u64, u64)) -> crate::Result<()> {
        DEFAULT.with(|d| *d.borrow_mut() = Generator::at(seed, offset));
        Ok(())
    }

    fn key(&self) -> usize {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn philox_known_answer() {
        // Random123's published known-answer vector for philox4x32-10 with zero input.
        assert_eq!(
            philox([0, 0, 0, 0], [0, 0]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
    }

    #[test]
    fn normal_moments() {
        let mut g = Generator::new(3);
        let x = g.normal(200_000);
        let mean = x.iter().sum::<f64>() / x.len() as f64;
        let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / x.len() as f64;
        assert!(mean.abs() < 0.01, "{mean}");
        assert!((var - 1.0).abs() < 0.02, "{var}");
        let u = g.uniform(100_000);
        assert!(u.iter().all(|&v| (0.0..1.0).contains(&v)));
    }
}
