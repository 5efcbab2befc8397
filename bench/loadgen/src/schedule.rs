//! Arrival schedules: per-connection rate distributions and open-loop
//! Poisson processes with piecewise-constant rates.
//!
//! The long-lived connections' arrivals are one Poisson process of the total
//! long-flow rate whose events are assigned to connection `i` with
//! probability `w_i` (alias method, O(1)); by the splitting property this is
//! exactly N independent Poisson processes of rates `R * w_i`, and one timer
//! drives them all. The step workload adds a second process whose rate
//! rises by a fixed step every interval, spread over a subset of
//! connections. Short flows are a third process of connection openings.

use capybara_testserver::rng::Rng;

/// Normalised Zipf weights over `n` ranks: `w_r ∝ 1 / (r+1)^alpha`.
pub fn zipf_weights(n: usize, alpha: f64) -> Vec<f64> {
    let raw: Vec<f64> = (0..n).map(|r| 1.0 / ((r + 1) as f64).powf(alpha)).collect();
    let sum: f64 = raw.iter().sum();
    raw.into_iter().map(|w| w / sum).collect()
}

/// Walker/Vose alias table: O(1) sampling from a discrete distribution.
#[derive(Clone, Debug)]
pub struct AliasTable {
    prob: Vec<f64>,
    alias: Vec<u32>,
}

impl AliasTable {
    /// `weights` must be non-empty, finite and non-negative with a positive sum.
    pub fn new(weights: &[f64]) -> AliasTable {
        let n = weights.len();
        assert!(n > 0, "alias table needs at least one weight");
        let sum: f64 = weights.iter().sum();
        let mut scaled: Vec<f64> = weights.iter().map(|w| w * n as f64 / sum).collect();
        let mut prob = vec![1.0; n];
        let mut alias: Vec<u32> = (0..n as u32).collect();
        let (mut small, mut large): (Vec<usize>, Vec<usize>) =
            (0..n).partition(|&i| scaled[i] < 1.0);
        while let (Some(s), Some(&l)) = (small.pop(), large.last()) {
            prob[s] = scaled[s];
            alias[s] = l as u32;
            scaled[l] -= 1.0 - scaled[s];
            if scaled[l] < 1.0 {
                large.pop();
                small.push(l);
            }
        }
        // Leftovers are 1 up to rounding.
        AliasTable { prob, alias }
    }

    #[inline]
    pub fn sample(&self, rng: &mut Rng) -> usize {
        let i = rng.below(self.prob.len() as u64) as usize;
        if rng.next_f64() < self.prob[i] {
            i
        } else {
            self.alias[i] as usize
        }
    }

    pub fn len(&self) -> usize {
        self.prob.len()
    }

    pub fn is_empty(&self) -> bool {
        self.prob.is_empty()
    }
}

/// A rate (events per second) that is constant between change points.
#[derive(Clone, Debug, PartialEq)]
pub enum RateFn {
    Const(f64),
    /// 0 before `start_ns`; then `step * k` during the k-th interval
    /// (k = 1, 2, ...), capped at `step * max_steps`.
    Step {
        start_ns: u64,
        interval_ns: u64,
        step: f64,
        max_steps: u64,
    },
}

impl RateFn {
    /// Rate at `t_ns` and the time of the next change (u64::MAX if none).
    pub fn at(&self, t_ns: u64) -> (f64, u64) {
        match *self {
            RateFn::Const(r) => (r, u64::MAX),
            RateFn::Step {
                start_ns,
                interval_ns,
                step,
                max_steps,
            } => {
                if t_ns < start_ns {
                    return (0.0, start_ns);
                }
                let k = (t_ns - start_ns) / interval_ns + 1;
                if k >= max_steps {
                    (step * max_steps as f64, u64::MAX)
                } else {
                    (step * k as f64, start_ns + k * interval_ns)
                }
            }
        }
    }

    /// Expected number of events in [0, t_ns).
    pub fn expected_events(&self, t_ns: u64) -> f64 {
        let mut t = 0u64;
        let mut n = 0.0;
        while t < t_ns {
            let (r, next) = self.at(t);
            let until = next.min(t_ns);
            n += r * (until - t) as f64 / 1e9;
            t = until;
        }
        n
    }
}

/// A Poisson process with a piecewise-constant rate, in nanoseconds from
/// the start of the run.
#[derive(Clone, Debug)]
pub struct Poisson {
    rate: RateFn,
    rng: Rng,
    next_ns: u64,
}

impl Poisson {
    pub fn new(rate: RateFn, rng: Rng) -> Poisson {
        let mut p = Poisson {
            rate,
            rng,
            next_ns: 0,
        };
        p.next_ns = p.after(0);
        p
    }

    /// Time of the next event (u64::MAX: none ever).
    #[inline]
    pub fn peek(&self) -> u64 {
        self.next_ns
    }

    /// Consume the current event and draw the next one.
    #[inline]
    pub fn advance(&mut self) -> u64 {
        let t = self.next_ns;
        self.next_ns = self.after(t);
        t
    }

    pub fn rng(&mut self) -> &mut Rng {
        &mut self.rng
    }

    fn after(&mut self, mut t: u64) -> u64 {
        loop {
            let (r, change) = self.rate.at(t);
            if r <= 0.0 {
                if change == u64::MAX {
                    return u64::MAX;
                }
                t = change;
                continue;
            }
            let gap = self.rng.exp(1e9 / r);
            let cand = t as f64 + gap;
            // Memorylessness: if the rate changes first, restart there.
            if cand >= change as f64 {
                t = change;
                continue;
            }
            return (cand as u64).max(t);
        }
    }
}

/// Parse a connection list such as `0-49` or `0,2,4-7`; every index < n.
pub fn parse_conn_list(s: &str, n: usize) -> Result<Vec<usize>, String> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (part, part),
        };
        let a: usize = a
            .parse()
            .map_err(|_| format!("invalid connection index {a:?} in {s:?}"))?;
        let b: usize = b
            .parse()
            .map_err(|_| format!("invalid connection index {b:?} in {s:?}"))?;
        if a > b {
            return Err(format!(
                "invalid connection range {part:?} in {s:?}: start after end"
            ));
        }
        if b >= n {
            return Err(format!(
                "connection index {b} in {s:?} out of range: only {n} long connections (0..{})",
                n.saturating_sub(1)
            ));
        }
        out.extend(a..=b);
    }
    out.sort_unstable();
    out.dedup();
    if out.is_empty() {
        return Err(format!("empty connection list {s:?}"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_interarrivals_match_the_rate() {
        let rate = 50_000.0;
        let mut p = Poisson::new(RateFn::Const(rate), Rng::new(7));
        let n = 200_000;
        let mut prev = p.advance();
        let mut gaps = Vec::with_capacity(n);
        for _ in 0..n {
            let t = p.advance();
            gaps.push((t - prev) as f64);
            prev = t;
        }
        let mean = gaps.iter().sum::<f64>() / n as f64;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / n as f64;
        let expected = 1e9 / rate;
        assert!(
            (mean / expected - 1.0).abs() < 0.01,
            "mean gap {mean} vs {expected}"
        );
        // Exponential: coefficient of variation 1.
        let cv = var.sqrt() / mean;
        assert!((cv - 1.0).abs() < 0.02, "cv {cv}");
        // Kolmogorov-Smirnov against the exponential CDF.
        gaps.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let d = gaps
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let f = 1.0 - (-g / expected).exp();
                (f - i as f64 / n as f64)
                    .abs()
                    .max((f - (i + 1) as f64 / n as f64).abs())
            })
            .fold(0.0, f64::max);
        // 1.63/sqrt(n): the 1% critical value.
        assert!(d < 1.63 / (n as f64).sqrt(), "KS distance {d}");
    }

    #[test]
    fn step_rate_rises_every_interval() {
        let r = RateFn::Step {
            start_ns: 20_000_000,
            interval_ns: 20_000_000,
            step: 1000.0,
            max_steps: 3,
        };
        assert_eq!(r.at(0), (0.0, 20_000_000));
        assert_eq!(r.at(20_000_000), (1000.0, 40_000_000));
        assert_eq!(r.at(59_999_999), (2000.0, 60_000_000));
        assert_eq!(r.at(60_000_000), (3000.0, u64::MAX));
        assert_eq!(r.at(1_000_000_000), (3000.0, u64::MAX));
        // Counts per interval follow the steps.
        let mut p = Poisson::new(r.clone(), Rng::new(3));
        let mut counts = [0u32; 5];
        loop {
            let t = p.advance();
            if t >= 100_000_000 {
                break;
            }
            counts[(t / 20_000_000) as usize] += 1;
        }
        assert_eq!(counts[0], 0);
        for (k, want) in [(1, 20.0), (2, 40.0), (3, 60.0), (4, 60.0)] {
            let got = counts[k] as f64;
            assert!(
                (got - want).abs() < 5.0 * want.sqrt(),
                "interval {k}: {got} vs {want}"
            );
        }
        assert!((r.expected_events(100_000_000) - 180.0).abs() < 1e-9);
    }

    #[test]
    fn alias_table_samples_zipf() {
        let w = zipf_weights(50, 1.2);
        let t = AliasTable::new(&w);
        let mut rng = Rng::new(11);
        let n = 1_000_000;
        let mut c = [0u32; 50];
        for _ in 0..n {
            c[t.sample(&mut rng)] += 1;
        }
        for (i, &wi) in w.iter().enumerate() {
            let exp = wi * n as f64;
            let sd = (exp * (1.0 - wi)).sqrt();
            assert!(
                (c[i] as f64 - exp).abs() < 5.0 * sd + 1.0,
                "rank {i}: {} vs {exp}",
                c[i]
            );
        }
    }

    #[test]
    fn conn_lists() {
        assert_eq!(
            parse_conn_list("0-3,7, 2", 10).unwrap(),
            vec![0, 1, 2, 3, 7]
        );
        assert!(parse_conn_list("5-2", 10).is_err());
        assert!(parse_conn_list("0-10", 10).is_err());
        assert!(parse_conn_list("x", 10).is_err());
        assert!(parse_conn_list("", 10).is_err());
    }
}
