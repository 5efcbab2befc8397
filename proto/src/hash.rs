//! Keyed hashing for tables indexed by what the network sends (flow keys
//! from client packets, migration ids from peers): the TCP endpoint's flow
//! map and the TCPMig engine's and glue's tables.
//!
//! foldhash (quality variant: one folded multiply of the key with secrets,
//! one more to finish) keyed with 128 secret bits from the OS random
//! generator (std's `RandomState`, which reads it once per thread): a
//! 64-bit seed shared by the process's tables and a 64-bit seed per table.
//! An attacker who cannot read the seeds cannot choose colliding keys
//! offline, as with SipHash; unlike SipHash, foldhash does not claim to
//! resist an attacker who recovers the seeds by timing many lookups (its
//! README, "HashDoS resistance"). ~10 instructions per hash instead of
//! SipHash-1-3's ~100, on every segment and migration message.

use std::collections::HashMap;
use std::hash::BuildHasher;

/// The keyed hasher (fresh seeds from [`keyed_hasher`]).
pub type KeyedHasher = foldhash::quality::SeedableRandomState;

/// A `HashMap` with a [`KeyedHasher`].
pub type KeyedMap<K, V> = HashMap<K, V, KeyedHasher>;

/// A hasher with a fresh per-table seed and the process's shared seed.
pub fn keyed_hasher() -> KeyedHasher {
    static SHARED: std::sync::OnceLock<foldhash::SharedSeed> = std::sync::OnceLock::new();
    // Each std `RandomState` has fresh secret SipHash keys from the OS.
    let os_random = || std::collections::hash_map::RandomState::new().hash_one(0x5eed_u64);
    let shared = SHARED.get_or_init(|| foldhash::SharedSeed::from_u64(os_random()));
    KeyedHasher::with_seed(os_random(), shared)
}

/// An empty [`KeyedMap`] with room for `capacity` entries and fresh keys.
pub fn keyed_map<K, V>(capacity: usize) -> KeyedMap<K, V> {
    HashMap::with_capacity_and_hasher(capacity, keyed_hasher())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_get_different_keys() {
        let (a, b) = (keyed_hasher(), keyed_hasher());
        assert_ne!(a.hash_one(42u64), b.hash_one(42u64));
        let mut m = keyed_map::<u64, u32>(4);
        m.insert(7, 1);
        assert_eq!(m.get(&7), Some(&1));
    }
}
