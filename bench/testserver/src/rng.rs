//! A small, fast, seedable PRNG (SplitMix64) and the samplers the benchmark
//! tools need. Deterministic for a given seed; not for cryptography.

/// SplitMix64 (Steele, Lea, Flood 2014): passes BigCrush, one add and a few
/// multiplies per draw.
#[derive(Clone, Debug)]
pub struct Rng {
    state: u64,
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng {
            state: seed ^ 0x9E37_79B9_7F4A_7C15,
        }
    }

    /// A new generator derived from this one's seed and a stream number, so
    /// independent streams do not overlap in practice.
    pub fn fork(&self, stream: u64) -> Rng {
        let mut r = Rng {
            state: self.state ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03),
        };
        r.next_u64();
        r
    }

    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    #[inline]
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in [0, n); n > 0.
    #[inline]
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// Exponentially distributed with the given mean.
    #[inline]
    pub fn exp(&mut self, mean: f64) -> f64 {
        // 1 - u is in (0, 1], so ln never sees 0.
        -(1.0 - self.next_f64()).ln() * mean
    }
}
