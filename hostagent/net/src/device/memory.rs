//! An in-memory Ethernet link with two ends, for tests.
//!
//! Deterministic: loss, duplication and reordering are drawn from a seeded
//! generator, so a failing seed replays exactly. Each direction is a bounded
//! queue (tail drop beyond `capacity`, counted). Frame buffers are recycled
//! through a free list, so a warmed-up link stops allocating.
//! Fault injection lives here, in a device, never inside the stack.

use super::{Device, DeviceError};
use crate::wire::EthernetAddress;
use capybara_proto::time::Duration;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// Knobs of a memory link (applied to both directions).
#[derive(Debug, Clone)]
pub struct LinkConfig {
    /// Probability in [0, 1] that a frame is lost.
    pub loss: f64,
    /// Probability that a frame is delivered twice.
    pub duplicate: f64,
    /// Probability that a frame overtakes the one queued before it.
    pub reorder: f64,
    pub seed: u64,
    /// Frames queued per direction before tail drop.
    pub capacity: usize,
    /// Largest frame (Ethernet header included).
    pub max_frame_len: usize,
}

impl Default for LinkConfig {
    fn default() -> Self {
        LinkConfig {
            loss: 0.0,
            duplicate: 0.0,
            reorder: 0.0,
            seed: 1,
            capacity: 1024,
            max_frame_len: 1514,
        }
    }
}

/// What the link did, summed over both directions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkStats {
    pub sent: u64,
    pub delivered: u64,
    pub lost: u64,
    pub duplicated: u64,
    pub reordered: u64,
    pub overflowed: u64,
}

/// SplitMix64: tiny, seedable, good enough for fault injection.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// True with probability `p`.
    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

#[derive(Debug)]
struct Shared {
    /// `queues[i]` holds frames waiting to be received by end `i`.
    queues: [VecDeque<Vec<u8>>; 2],
    free: Vec<Vec<u8>>,
    rng: Rng,
    stats: LinkStats,
    config: LinkConfig,
}

#[derive(Debug)]
struct Link {
    shared: Mutex<Shared>,
    arrived: Condvar,
}

/// One end of a memory link.
#[derive(Debug)]
pub struct MemoryDevice {
    link: Arc<Link>,
    side: usize,
    mac: Option<EthernetAddress>,
    /// Frames moved out of the shared queue for one receive batch.
    batch: Vec<Vec<u8>>,
}

/// Creates the two ends of a link.
pub fn pair(config: LinkConfig) -> (MemoryDevice, MemoryDevice) {
    let link = Arc::new(Link {
        shared: Mutex::new(Shared {
            queues: [VecDeque::new(), VecDeque::new()],
            free: Vec::new(),
            rng: Rng(config.seed),
            stats: LinkStats::default(),
            config,
        }),
        arrived: Condvar::new(),
    });
    let end = |side| MemoryDevice {
        link: link.clone(),
        side,
        mac: None,
        batch: Vec::new(),
    };
    (end(0), end(1))
}

impl MemoryDevice {
    /// Sets the address reported by `Device::mac`.
    pub fn with_mac(mut self, mac: EthernetAddress) -> Self {
        self.mac = Some(mac);
        self
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        lock(&self.link)
    }

    pub fn stats(&self) -> LinkStats {
        self.lock().stats
    }

    /// Frames waiting to be received by this end.
    pub fn pending(&self) -> usize {
        self.lock().queues[self.side].len()
    }

    /// Changes the fault knobs (e.g. to heal a lossy link mid-test).
    pub fn set_faults(&self, loss: f64, duplicate: f64, reorder: f64) {
        let mut s = self.lock();
        s.config.loss = loss;
        s.config.duplicate = duplicate;
        s.config.reorder = reorder;
    }
}

fn lock(link: &Link) -> MutexGuard<'_, Shared> {
    // A test that panicked while holding the lock already failed; keep the
    // link usable for its cleanup.
    link.shared.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn enqueue(&mut self, to: usize, frame: Vec<u8>) {
        self.stats.sent += 1;
        if self.rng.chance(self.config.loss) {
            self.stats.lost += 1;
            self.free.push(frame);
            return;
        }
        let copies = if self.rng.chance(self.config.duplicate) {
            2
        } else {
            1
        };
        let mut frame = Some(frame);
        for c in 0..copies {
            if self.queues[to].len() >= self.config.capacity {
                self.stats.overflowed += 1;
                break;
            }
            let f = if c + 1 == copies {
                frame.take().unwrap_or_default()
            } else {
                let mut d = self.free.pop().unwrap_or_default();
                d.clear();
                d.extend_from_slice(frame.as_deref().unwrap_or_default());
                self.stats.duplicated += 1;
                d
            };
            let q = &mut self.queues[to];
            if !q.is_empty() && self.rng.chance(self.config.reorder) {
                self.stats.reordered += 1;
                q.insert(q.len() - 1, f);
            } else {
                q.push_back(f);
            }
        }
        if let Some(f) = frame {
            self.free.push(f);
        }
    }
}

impl Device for MemoryDevice {
    fn receive(&mut self, max: usize, f: &mut dyn FnMut(&[u8])) -> Result<usize, DeviceError> {
        {
            let mut s = lock(&self.link);
            let q = &mut s.queues[self.side];
            let n = max.min(q.len());
            self.batch.extend(q.drain(..n));
            s.stats.delivered += n as u64;
        }
        // The callback runs without the lock: it may transmit on this link.
        for frame in &self.batch {
            f(frame);
        }
        let n = self.batch.len();
        let mut s = lock(&self.link);
        s.free.append(&mut self.batch);
        Ok(n)
    }

    fn transmit(
        &mut self,
        max: usize,
        f: &mut dyn FnMut(&mut [u8]) -> Option<usize>,
    ) -> Result<usize, DeviceError> {
        let frame_len = self.max_frame_len();
        let mut sent = 0;
        let mut buf = self.lock().free.pop().unwrap_or_default();
        while sent < max {
            buf.clear();
            buf.resize(frame_len, 0);
            let Some(len) = f(&mut buf) else { break };
            buf.truncate(len.min(frame_len));
            let mut s = self.lock();
            s.enqueue(1 - self.side, std::mem::take(&mut buf));
            buf = s.free.pop().unwrap_or_default();
            sent += 1;
        }
        let mut s = self.lock();
        s.free.push(buf);
        drop(s);
        if sent > 0 {
            self.link.arrived.notify_all();
        }
        Ok(sent)
    }

    fn wait(&mut self, timeout: Option<Duration>) -> Result<(), DeviceError> {
        let s = self.lock();
        if !s.queues[self.side].is_empty() {
            return Ok(());
        }
        let side = self.side;
        let cond = |s: &mut Shared| s.queues[side].is_empty();
        match timeout {
            Some(t) => drop(
                self.link
                    .arrived
                    .wait_timeout_while(s, t, cond)
                    .unwrap_or_else(|e| e.into_inner()),
            ),
            None => drop(
                self.link
                    .arrived
                    .wait_while(s, cond)
                    .unwrap_or_else(|e| e.into_inner()),
            ),
        }
        Ok(())
    }

    fn mac(&self) -> Option<EthernetAddress> {
        self.mac
    }

    fn max_frame_len(&self) -> usize {
        self.lock().config.max_frame_len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send(d: &mut MemoryDevice, frames: &[&[u8]]) {
        let mut it = frames.iter();
        d.transmit(usize::MAX, &mut |buf| {
            let f = it.next()?;
            buf[..f.len()].copy_from_slice(f);
            Some(f.len())
        })
        .unwrap();
    }

    fn recv(d: &mut MemoryDevice) -> Vec<Vec<u8>> {
        let mut out = vec![];
        d.receive(usize::MAX, &mut |f| out.push(f.to_vec()))
            .unwrap();
        out
    }

    #[test]
    fn clean_link_delivers_in_order() {
        let (mut a, mut b) = pair(LinkConfig::default());
        send(&mut a, &[b"one", b"two", b"three"]);
        assert_eq!(
            recv(&mut b),
            vec![b"one".to_vec(), b"two".to_vec(), b"three".to_vec()]
        );
        assert!(recv(&mut a).is_empty());
        send(&mut b, &[b"back"]);
        assert_eq!(recv(&mut a), vec![b"back".to_vec()]);
    }

    #[test]
    fn faults_are_deterministic_per_seed() {
        let run = |seed| {
            let (mut a, mut b) = pair(LinkConfig {
                loss: 0.2,
                duplicate: 0.1,
                reorder: 0.1,
                seed,
                ..Default::default()
            });
            let frames: Vec<Vec<u8>> = (0..200u8).map(|i| vec![i]).collect();
            let refs: Vec<&[u8]> = frames.iter().map(|f| &f[..]).collect();
            send(&mut a, &refs);
            (recv(&mut b), a.stats())
        };
        let (x, sx) = run(7);
        let (y, _) = run(7);
        let (z, _) = run(8);
        assert_eq!(x, y);
        assert_ne!(x, z);
        assert!(
            sx.lost > 10 && sx.duplicated > 5 && sx.reordered > 5,
            "{sx:?}"
        );
        assert_eq!(sx.sent, 200);
    }

    #[test]
    fn bounded_queue_tail_drops() {
        let (mut a, mut b) = pair(LinkConfig {
            capacity: 3,
            ..Default::default()
        });
        send(&mut a, &[b"1", b"2", b"3", b"4", b"5"]);
        assert_eq!(recv(&mut b).len(), 3);
        assert_eq!(a.stats().overflowed, 2);
    }

    #[test]
    fn wait_wakes_on_arrival_or_timeout() {
        let (mut a, mut b) = pair(LinkConfig::default());
        let t = std::time::Instant::now();
        b.wait(Some(Duration::from_millis(20))).unwrap();
        assert!(t.elapsed() >= std::time::Duration::from_millis(20));
        let h = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(10));
            send(&mut a, &[b"x"]);
            a
        });
        b.wait(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(recv(&mut b).len(), 1);
        h.join().unwrap();
    }
}
