//! Weighted Maglev consistent hashing (Eisenbud et al., NSDI'16) and the
//! flow hash the data plane uses to index the table.
//!
//! Invariants:
//! - [`flow_hash`] is bit-identical to `flow_hash()` in `bpf/switch.bpf.c`
//!   (tested through BPF_PROG_TEST_RUN in `tests/dataplane.rs`).
//! - A table depends only on the set of (server id, data-plane index,
//!   weight) and the table size, never on insertion order or on the
//!   process: the golden test pins its hash so that an upgrade of switchd
//!   never reshuffles established connections.

use crate::abi::{CFlowKey, HASH_SEED, NO_SERVER};
use capybara_proto::FlowKey;

/// murmur3 32-bit finaliser (same as `mix32` in the C program).
pub const fn mix32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    h
}

/// Hash of a flow as the data plane computes it.
pub fn flow_hash(k: &FlowKey) -> u32 {
    let mut h = HASH_SEED;
    h = mix32(h ^ u32::from(k.client_ip));
    h = mix32(h ^ ((u32::from(k.client_port) << 16) | u32::from(k.service_port)));
    h = mix32(h ^ u32::from(k.service_ip));
    h
}

/// Same, from the data plane's key layout.
pub fn flow_hash_c(k: &CFlowKey) -> u32 {
    flow_hash(&FlowKey::from(*k))
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// One backend of a Maglev table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backend {
    /// Stable identity (the server id): decides the backend's permutation,
    /// so it must not change when the server re-registers.
    pub id: u32,
    /// Value written into the table (the data-plane server index).
    pub index: u32,
    /// Relative weight; 0 takes the backend out of the table.
    pub weight: u32,
}

/// Builds a table of `size` slots (`size` must be prime for the
/// permutations to be full cycles). Empty or all-zero-weight pools give a
/// table of [`NO_SERVER`].
///
/// Weights: backends take turns filling their next preferred free slot; in
/// each turn a backend earns credit equal to its weight and places one
/// entry per `max_weight` of credit, so its share converges to
/// weight / sum(weights).
pub fn build_table(backends: &[Backend], size: u32) -> Vec<u32> {
    let m = size as u64;
    let mut table = vec![NO_SERVER; size as usize];
    let mut pool: Vec<Backend> = backends.iter().copied().filter(|b| b.weight > 0).collect();
    if pool.is_empty() || size < 2 {
        return table;
    }
    // Order-independence: the filling order is part of the result.
    pool.sort_by_key(|b| (b.id, b.index));
    let max_w = pool.iter().map(|b| b.weight as u64).max().unwrap_or(1);
    let offsets: Vec<u64> = pool
        .iter()
        .map(|b| splitmix64(b.id as u64 ^ 0xA5A5_0001) % m)
        .collect();
    let skips: Vec<u64> = pool
        .iter()
        .map(|b| splitmix64(b.id as u64 ^ 0x5A5A_0002) % (m - 1) + 1)
        .collect();
    let mut next = vec![0u64; pool.len()];
    let mut credit = vec![0u64; pool.len()];
    let mut filled = 0u64;
    while filled < m {
        for i in 0..pool.len() {
            credit[i] += pool[i].weight as u64;
            while credit[i] >= max_w && filled < m {
                credit[i] -= max_w;
                // Next free slot in this backend's permutation; at most m
                // probes since the permutation is a full cycle.
                loop {
                    let slot = (offsets[i] + next[i] * skips[i]) % m;
                    next[i] += 1;
                    if table[slot as usize] == NO_SERVER {
                        table[slot as usize] = pool[i].index;
                        filled += 1;
                        break;
                    }
                }
            }
        }
    }
    table
}

/// Slots that differ between two tables of the same size: the delta pushed
/// to the data plane.
pub fn diff(old: &[u32], new: &[u32]) -> Vec<(u32, u32)> {
    new.iter()
        .enumerate()
        .filter(|(i, v)| old.get(*i) != Some(v))
        .map(|(i, v)| (i as u32, *v))
        .collect()
}

/// FNV-1a over the table, for golden tests and logs.
pub fn table_fingerprint(table: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in table {
        for b in v.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn pool(ws: &[u32]) -> Vec<Backend> {
        ws.iter()
            .enumerate()
            .map(|(i, w)| Backend {
                id: 100 + i as u32,
                index: i as u32,
                weight: *w,
            })
            .collect()
    }

    fn shares(t: &[u32], n: usize) -> Vec<usize> {
        let mut c = vec![0; n];
        for v in t {
            c[*v as usize] += 1;
        }
        c
    }

    #[test]
    fn golden_table_is_pinned() {
        // If this fails, an upgrade would move established flows. Only
        // change the pinned value with a migration plan.
        let t = build_table(&pool(&[1, 1, 2, 3]), 65537);
        assert_eq!(t.len(), 65537);
        assert_eq!(
            table_fingerprint(&t),
            GOLDEN_4_SERVERS,
            "fingerprint {:#x}",
            table_fingerprint(&t)
        );
        let t = build_table(&pool(&[1, 1, 1]), 251);
        assert_eq!(&t[..12], &GOLDEN_SMALL_PREFIX, "{:?}", &t[..12]);
    }
    const GOLDEN_4_SERVERS: u64 = 0xe68f_4847_43d8_b0b7;
    const GOLDEN_SMALL_PREFIX: [u32; 12] = [2, 0, 2, 2, 0, 2, 0, 0, 1, 0, 2, 1];

    #[test]
    fn weights_are_respected() {
        let t = build_table(&pool(&[1, 1, 2, 4]), 65537);
        let s = shares(&t, 4);
        let total: usize = s.iter().sum();
        assert_eq!(total, 65537);
        for (i, w) in [1.0, 1.0, 2.0, 4.0].iter().enumerate() {
            let expected = 65537.0 * w / 8.0;
            let got = s[i] as f64;
            assert!(
                (got - expected).abs() / expected < 0.02,
                "server {i}: {got} vs {expected}"
            );
        }
    }

    #[test]
    fn order_independent_and_empty() {
        let mut p = pool(&[3, 1, 2]);
        let a = build_table(&p, 1009);
        p.reverse();
        assert_eq!(a, build_table(&p, 1009));
        assert!(build_table(&[], 1009).iter().all(|v| *v == NO_SERVER));
        assert!(build_table(&pool(&[0, 0]), 1009)
            .iter()
            .all(|v| *v == NO_SERVER));
    }

    #[test]
    fn removing_a_server_moves_only_its_slots_mostly() {
        let before = build_table(&pool(&[1; 10]), 65537);
        let mut p = pool(&[1; 10]);
        p.remove(3);
        let after = build_table(&p, 65537);
        let moved_others = before
            .iter()
            .zip(&after)
            .filter(|(b, a)| **b != 3 && b != a)
            .count();
        // Maglev's guarantee is "minimal disruption", not zero: allow 2%.
        assert!(moved_others < 65537 / 50, "moved {moved_others}");
        assert!(after.iter().all(|v| *v != 3));
        let d = diff(&before, &after);
        assert!(d.iter().all(|(slot, v)| before[*slot as usize] != *v));
    }

    #[test]
    fn flow_hash_is_stable() {
        let k = FlowKey {
            client_ip: Ipv4Addr::new(198, 18, 0, 11),
            client_port: 40000,
            service_ip: Ipv4Addr::new(198, 18, 100, 1),
            service_port: 80,
        };
        assert_eq!(flow_hash(&k), GOLDEN_FLOW_HASH, "{:#x}", flow_hash(&k));
        assert_eq!(flow_hash_c(&CFlowKey::from(k)), flow_hash(&k));
    }
    const GOLDEN_FLOW_HASH: u32 = 0xd6ba_8517;
}
