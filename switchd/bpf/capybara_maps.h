/* SPDX-License-Identifier: Apache-2.0 */
/*
 * capybara_maps.h: every map of the switch data plane and every struct that
 * crosses the kernel/user boundary, in one place.
 *
 * The Rust mirror is switchd/src/abi.rs (`#[repr(C)]`); the test
 * switchd/tests/abi_layout.rs compiles this header with the system C
 * compiler and compares every sizeof/offsetof and constant with the Rust
 * side, so the two cannot drift silently. Change both together.
 *
 * Invariants:
 *  - The data plane makes no policy decision. Maglev tables, placement
 *    rings (LWRR) and migration-target rings are computed by the control
 *    plane and pushed as deltas; the program only looks up, rewrites,
 *    forwards and counts.
 *  - Addresses and ports inside keys are in network byte order (as read off
 *    the wire) so that the fast path never byte-swaps to build a key.
 *  - Server indexes are small integers < CAPY_MAX_SERVERS. Index 0 is valid.
 */
#ifndef CAPYBARA_MAPS_H
#define CAPYBARA_MAPS_H

#ifndef CAPY_USERSPACE
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#else
#include <linux/types.h>
#endif

/* ------------------------------------------------------------------------ */
/* Sizes                                                                    */
/* ------------------------------------------------------------------------ */

#define CAPY_MAX_SERVERS 256
#define CAPY_MAX_SERVICES 16
/* Maglev lookup table size per service: a prime well above 100x the largest
 * pool so that each server's share is within ~1% of its weight. */
#define CAPY_MAGLEV_SIZE 65537
/* Flow table capacity (LRU: the least recently used flow is evicted first). */
#define CAPY_MAX_FLOWS 2097152
/* Migration table capacity: migrated connections only. */
#define CAPY_MAX_MIGRATIONS 524288
/* Entries of a placement / target ring (see struct capy_ring). */
#define CAPY_RING_SIZE 256
#define CAPY_MAX_IFACES 64
/* Seed of the flow hash shared with user space (src/maglev.rs). */
#define CAPY_HASH_SEED 0x9E3779B9u

/* ------------------------------------------------------------------------ */
/* Enumerations                                                             */
/* ------------------------------------------------------------------------ */

/* capy_server.state */
#define CAPY_SERVER_EMPTY 0    /* slot unused                                   */
#define CAPY_SERVER_LIVE 1     /* takes new flows, owns flows                   */
#define CAPY_SERVER_DRAINING 2 /* no new flows; existing flows still forwarded */
#define CAPY_SERVER_DEAD 3     /* missed heartbeats: its packets are dropped    */

/* capy_iface.role */
#define CAPY_IFACE_CLIENT 1 /* faces clients: TCPMig arriving here is forged */
#define CAPY_IFACE_SERVER 2 /* faces servers                                  */

/* capy_service.placement */
#define CAPY_PLACE_MAGLEV 0 /* new flows hashed into the service's Maglev table */
#define CAPY_PLACE_RING 1   /* new flows take the next slot of the LWRR ring    */
#define CAPY_PLACE_NONE 2   /* retiring (deleted) service: established flows    *
			     * are forwarded, nothing new is placed: a segment  *
			     * without a flow is answered with a reset          */

/* capy_service.flags */
/* Every pool member is out for a lasting reason (drained or draining by the
 * operator, operator weight 0, dead past its grace), set by the control
 * plane: a SYN (without ACK) that finds no usable server is answered with a
 * reset, as a host answers for a closed port, instead of being dropped (the
 * client fails at once instead of retrying for minutes). Without it (no
 * member known yet, a member dead within its grace, the first dead_after of
 * an active switchd) such a SYN is dropped: its retransmission may succeed.
 * The program refuses only when its own lookup found no usable server, so a
 * flag that lags a table push never refuses a placeable SYN. */
#define CAPY_SVC_REFUSE 0x1

/* capy_flow.flags */
#define CAPY_FLOW_MIGRATED 0x1   /* a migration-table entry exists or existed   */
#define CAPY_FLOW_CLOSING 0x2    /* FIN seen both ways; closed event sent       */
#define CAPY_FLOW_FIN_CLIENT 0x4 /* FIN seen from the client                    */
#define CAPY_FLOW_FIN_SERVER 0x8 /* FIN seen from the server (response side)    */
/* The client sent a non-SYN segment (its handshake ACK or later): the flow is
 * no longer embryonic. Flows without it (a SYN seen, nothing after: scans,
 * SYN floods, clients that gave up) are reaped by the control plane's
 * embryonic scan once older than embryonic_timeout_ms. */
#define CAPY_FLOW_ESTABLISHED 0x10
/* Made by the program for a client's SYN (a new connection, maybe on a
 * 4-tuple a closed connection used), and no PREPARE of the flow has passed
 * since: a PREPARE_ACK or CONN_STATE_ACK that finds no migration entry is
 * then the closed connection's (its migration was in flight at the client's
 * reset; the target answered a duplicate PREPARE late) and must not take
 * the new connection. Cleared by the flow's first PREPARE. */
#define CAPY_FLOW_UNPREPARED 0x20

/* capy_migration.pending */
#define CAPY_MIG_FINAL 0
#define CAPY_MIG_PENDING 1

/* Recently steered PREPAREs remembered (migration id -> target index), so
 * that retransmissions of one migration go to the same target. */
#define CAPY_PREPARE_MEMORY 8192

/* Origins whose last migration id is remembered (origin_ids): far more
 * data addresses than servers, so that only addresses long gone give way. */
#define CAPY_ORIGIN_IDS 1024

/* Outcomes (CONN_STATE_ACK, ABORT decision) of migrations whose entry this
 * program did not hold, remembered for a takeover's end (unmatched_outcomes). */
#define CAPY_UNMATCHED_OUTCOMES 1024

/* capy_flow_event.kind */
#define CAPY_EV_NEW 1      /* flow placed on `server`                          */
#define CAPY_EV_MIGRATED 2 /* migration final (CONN_STATE_ACK): owner `prev_server` -> `server` */
#define CAPY_EV_RETURNED 3 /* same, back to its original server (entry kept, final) */
#define CAPY_EV_CLOSED 4   /* client FIN or RST                                */

/* Which ring of a service (index = service * CAPY_RING_KINDS + kind). */
#define CAPY_RING_PLACEMENT 0 /* LWRR placement of new flows               */
#define CAPY_RING_TARGET 1    /* migration targets for PREPARE (RR or LL)   */
#define CAPY_RING_KINDS 2

/* capy_ring.mode */
#define CAPY_RING_ROTATE 0 /* next entry at each use (round robin, LWRR)         */
#define CAPY_RING_FIRST 1  /* first entry, or the second if the first must be
			    * skipped (least-loaded target, origin excluded)  */
#define CAPY_RING_PAIRED 2 /* (target, alternate) pairs: the next pair at each
			    * use, its alternate if the target must be skipped
			    * (weighted round-robin target, origin excluded)  */

/* Reasons, one counter each in `stats`. Every verdict of the program
 * increments exactly one of them, so sum(stats) == packets seen. */
enum capy_stat {
	CAPY_STAT_PASS_NOT_IPV4 = 0,      /* ARP, IPv6...: kernel handles it         */
	CAPY_STAT_PASS_NOT_SERVICE,       /* IPv4 not to a VIP nor TCPMig: kernel     */
	CAPY_STAT_PASS_UNKNOWN_IFACE,     /* ingress interface not configured        */
	CAPY_STAT_FWD_NEW_FLOW,           /* SYN placed on a server                   */
	CAPY_STAT_FWD_ESTABLISHED,        /* flow-table hit                           */
	CAPY_STAT_FWD_MIGRATED,           /* migration-table hit                      */
	CAPY_STAT_FWD_RECOVERED,          /* non-SYN without entry, placed by Maglev  */
	CAPY_STAT_FWD_PREPARE,            /* PREPARE steered to a target              */
	CAPY_STAT_FWD_PREPARE_ACK,        /* PREPARE-ACK: entry installed, to origin  */
	CAPY_STAT_FWD_TCPMIG,             /* other TCPMig kinds between servers       */
	CAPY_STAT_DROP_SHORT_ETH,         /* frame shorter than an Ethernet header    */
	CAPY_STAT_DROP_BAD_IPV4,          /* truncated, bad version/IHL/total length  */
	CAPY_STAT_DROP_IP_FRAGMENT,       /* fragment to a VIP: no L4 header to hash  */
	CAPY_STAT_DROP_SHORT_L4,          /* truncated TCP/UDP header                 */
	CAPY_STAT_DROP_NO_SERVER,         /* service has no usable server             */
	CAPY_STAT_DROP_NO_FLOW,           /* non-SYN, no entry, ring placement        */
	CAPY_STAT_DROP_SERVER_DOWN,       /* flow owner is dead or unknown            */
	CAPY_STAT_DROP_TCPMIG_FROM_CLIENT,/* TCPMig on a client-side interface        */
	CAPY_STAT_DROP_TCPMIG_MALFORMED,  /* bad magic/version/length/kind            */
	CAPY_STAT_DROP_TCPMIG_UNKNOWN,    /* origin/target not a registered server    */
	CAPY_STAT_DROP_TCPMIG_NO_TARGET,  /* PREPARE with no candidate target         */
	CAPY_STAT_DROP_MIGRATION_FULL,    /* migration table full on PREPARE-ACK      */
	CAPY_STAT_DROP_PREPARE_ACK_STALE, /* PREPARE-ACK of an old migration, or the flow is mid-migration */
	CAPY_STAT_DROP_ABORT_UNMATCHED,   /* ABORT request to the switch, no pending entry of that id */
	CAPY_STAT_EVENT_LOST,             /* flow event not delivered: ring buffer full (not a verdict) */
	CAPY_STAT_RESET_RETIRED,          /* segment to a retiring service without a flow: answered with a reset */
	CAPY_STAT_RESET_NO_SERVER,        /* SYN, no usable server, service CAPY_SVC_REFUSE: answered with a reset */
	CAPY_STAT_MAX,
};

/* ------------------------------------------------------------------------ */
/* Structs (mirrored in src/abi.rs)                                         */
/* ------------------------------------------------------------------------ */

/* A TCP connection as the client sees it (proto::FlowKey), network order. */
struct capy_flow_key {
	__be32 client_ip;
	__be32 service_ip;
	__be16 client_port;
	__be16 service_port;
};

/* Flow-table value: where the connection was placed at SYN time. */
struct capy_flow {
	__u32 server;      /* original server index (placement)         */
	__u16 service;     /* service index, for per-service accounting */
	__u16 flags;       /* CAPY_FLOW_*                                */
	__u64 created_ns;  /* bpf_ktime_get_ns() (CLOCK_MONOTONIC) when the
			    * entry was made; ages embryonic flows      */
};

/* Migration-table value (docs/MIGRATION.md, "What the switch must do").
 * pending = 1: installed by PREPARE_ACK of `migration_id`, pointing at its
 * target, until CONN_STATE_ACK (target committed: final, same owner) or the
 * target's ABORT decision (final, owner = origin) passes the switch.
 * pending = 0 (final): `server` owns the flow. A final entry pointing at the
 * flow's original server is kept (not deleted) as a tombstone, so that a
 * stale PREPARE_ACK of an older migration cannot redirect the flow. */
struct capy_migration {
	__u32 server;        /* owner (final) or target (pending), server index */
	__u8 pending;        /* CAPY_MIG_PENDING / CAPY_MIG_FINAL                */
	__u8 pad[3];         /* 0                                               */
	__u64 migration_id;  /* host order: origin data addr << 32 | counter    */
};

/* A server of the pool, as the data plane needs it to forward. */
struct capy_server {
	__be32 data_ip;   /* data address owned by the server's user-space stack */
	__u32 ifindex;    /* switch interface leading to the server             */
	__u8 mac[6];      /* server's MAC (next hop)                            */
	__u8 src_mac[6];  /* switch's MAC on that interface                     */
	__u8 state;       /* CAPY_SERVER_*                                      */
	__u8 flags;       /* reserved, 0                                        */
	__u16 weight;     /* informative; placement uses the pushed tables      */
};

/* Service key: VIP and port, network order. */
struct capy_service_key {
	__be32 vip;
	__be16 port;
	__u8 proto; /* IPPROTO_TCP */
	__u8 pad;
};

struct capy_service {
	__u32 index;     /* < CAPY_MAX_SERVICES: row of maglev / rings       */
	__u32 placement; /* CAPY_PLACE_*                                     */
	__u32 flags;     /* CAPY_SVC_*                                       */
};

/* A ring of server indexes the program rotates through with an atomic
 * cursor: the LWRR placement sequence (weights already expanded by the
 * control plane) or the migration-target sequence (round robin over live
 * servers, by weight as (target, alternate) pairs when the weights differ,
 * or the two least-loaded servers). */
struct capy_ring {
	__u32 len;  /* 0 = empty: nothing to choose from */
	__u32 mode; /* CAPY_RING_ROTATE, CAPY_RING_FIRST or CAPY_RING_PAIRED */
	__u32 servers[CAPY_RING_SIZE];
};

/* Role and MAC of a switch interface. */
struct capy_iface {
	__u32 role; /* CAPY_IFACE_* */
	__u8 mac[6];
	__u16 pad;
};

/* Global configuration (single slot). */
struct capy_config {
	__be32 switch_server_ip; /* switch's address on the server side: PREPAREs go here */
	__u32 flags;             /* reserved, 0                                           */
};

/* Pool-monitor counters of one server (per CPU, summed by user space). */
struct capy_server_stats {
	__u64 packets; /* client->server packets forwarded to this server */
	__u64 bytes;
	/* Of those, the ones carrying TCP payload (request packets): the pool
	 * monitor's load (a bare ACK is no work for the server, and a busy
	 * connection piggybacks its ACKs on requests while a light one does
	 * not). */
	__u64 requests;
};

/* Flow event for the store (through the ring buffer). */
struct capy_flow_event {
	struct capy_flow_key key;
	__u32 kind;        /* CAPY_EV_* */
	__u32 server;      /* new owner (or owner when closed)   */
	__u32 prev_server; /* previous owner, for MIGRATED/RETURNED; else same */
	__u64 ts_ns;       /* bpf_ktime_get_ns()                  */
};

#ifndef CAPY_USERSPACE
/* ------------------------------------------------------------------------ */
/* Maps                                                                     */
/* ------------------------------------------------------------------------ */

/* Flow table: every connection seen, FlowKey -> original server. LRU so a
 * flood of SYNs evicts the oldest idle flows instead of failing inserts. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, CAPY_MAX_FLOWS);
	__type(key, struct capy_flow_key);
	__type(value, struct capy_flow);
} flows SEC(".maps");

/* Migration table (seed §7.1): migrated connections only, FlowKey ->
 * {owner, migration id, pending}. Written by the program on PREPARE-ACK,
 * CONN_STATE_ACK and the target's ABORT decision (struct capy_migration);
 * deleted when the connection closes or its owner dies.
 * Plain hash (not LRU): an entry must never be silently forgotten, or the
 * connection would go back to a server that no longer holds it. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, CAPY_MAX_MIGRATIONS);
	__type(key, struct capy_flow_key);
	__type(value, struct capy_migration);
} migrations SEC(".maps");

/* Servers by index: forwarding data and liveness state. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, CAPY_MAX_SERVERS);
	__type(key, __u32);
	__type(value, struct capy_server);
} servers SEC(".maps");

/* PREPARE steering memory: migration id (host order) -> target index, so
 * that every retransmission of one migration reaches the same target. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, CAPY_PREPARE_MEMORY);
	__type(key, __u64);
	__type(value, __u32);
} prepare_targets SEC(".maps");

/* Last migration id seen per origin: origin data address (network order,
 * a PREPARE's `origin` field, that of a registered server) -> the newest id
 * (host order) of the PREPAREs from it, newest in serial-number arithmetic
 * on the low 32 bits. switchd tells a (re)registering server its entry in
 * REGISTER_ACK, so that a restarted hostagent numbers its migrations above
 * the ids this program's PREPARE steering memory and the targets may still
 * remember (docs/MIGRATION.md, "Roles and messages"). Never cleared with a
 * server: its ids outlive it. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, CAPY_ORIGIN_IDS);
	__type(key, __be32);
	__type(value, __u64);
} origin_ids SEC(".maps");

/* Outcomes this program saw of migrations whose pending entry it did not
 * hold: migration id (host order) -> the final entry the outcome makes
 * (CONN_STATE_ACK: owner the target; the target's ABORT decision: owner the
 * origin). During a takeover in place the predecessor's program and this
 * one both forward until the last link is replaced: a PREPARE_ACK that
 * passed the predecessor (pending there) and whose outcome passed this
 * program before the predecessor's entry was applied here is settled from
 * this memory by switchd's finish_adoption (bpf.rs). Written only on that
 * rare path, never read by the program. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, CAPY_UNMATCHED_OUTCOMES);
	__type(key, __u64);
	__type(value, struct capy_migration);
} unmatched_outcomes SEC(".maps");

/* Server data address -> server index, to resolve TCPMig origin/target. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, CAPY_MAX_SERVERS);
	__type(key, __be32);
	__type(value, __u32);
} server_by_addr SEC(".maps");

/* Services: VIP:port -> service index and placement mode. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, CAPY_MAX_SERVICES);
	__type(key, struct capy_service_key);
	__type(value, struct capy_service);
} services SEC(".maps");

/* Maglev lookup tables of all services, row-major: slot
 * service * CAPY_MAGLEV_SIZE + hash % CAPY_MAGLEV_SIZE -> server index.
 * Mmapable: the control plane writes changed slots through a shared mapping
 * (plain aligned 32-bit stores, one per slot, each seen whole by the program)
 * instead of BPF_MAP_UPDATE_BATCH system calls (13-28 ms in all when half
 * of a table changed; src/bpf.rs, `MaglevMem`). The kernel lays an array's
 * elements out every round_up(value_size, 8) = 8 bytes. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, CAPY_MAX_SERVICES * CAPY_MAGLEV_SIZE);
	__type(key, __u32);
	__type(value, __u32);
} maglev SEC(".maps");

/* Rings (LWRR placement, migration targets): service * CAPY_RING_KINDS + kind. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, CAPY_MAX_SERVICES * CAPY_RING_KINDS);
	__type(key, __u32);
	__type(value, struct capy_ring);
} rings SEC(".maps");

/* Ring cursors, same index as `rings`; advanced atomically (shared across
 * CPUs so round robin is exact, not per-CPU). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, CAPY_MAX_SERVICES * CAPY_RING_KINDS);
	__type(key, __u32);
	__type(value, __u64);
} ring_cursors SEC(".maps");

/* Switch interfaces by ifindex: client or server side, and own MAC. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, CAPY_MAX_IFACES);
	__type(key, __u32);
	__type(value, struct capy_iface);
} ifaces SEC(".maps");

/* Egress ports for XDP_REDIRECT, ifindex -> ifindex. */
struct {
	__uint(type, BPF_MAP_TYPE_DEVMAP_HASH);
	__uint(max_entries, CAPY_MAX_IFACES);
	__type(key, __u32);
	__type(value, __u32);
} tx_ports SEC(".maps");

/* Global configuration, slot 0. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct capy_config);
} config SEC(".maps");

/* Pool monitor: per-server packet counters, per CPU, monotonic (user space
 * diffs successive reads, so nothing races with a reset). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, CAPY_MAX_SERVERS);
	__type(key, __u32);
	__type(value, struct capy_server_stats);
} server_stats SEC(".maps");

/* Verdict and drop-reason counters, enum capy_stat, per CPU. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, CAPY_STAT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} stats SEC(".maps");

/* Flow events (struct capy_flow_event) for persistence; user space drains
 * it in batches. Full ring = event lost and counted, never a stall. */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 22);
} flow_events SEC(".maps");
#endif /* !CAPY_USERSPACE */

#endif /* CAPYBARA_MAPS_H */
