/* SPDX-License-Identifier: Apache-2.0 */
/*
 * capybara_proto.h: the Capybara wire contract as seen from C / eBPF.
 *
 * The source of truth is the Rust crate `capybara-proto` (proto/src/).
 * This header is NOT generated: it is checked against the Rust constants by
 * proto/tests/c_header.rs, which compiles a C program against this file with
 * the system `cc` and compares every sizeof/offsetof with the Rust side.
 * Change both together; the test fails otherwise.
 *
 * Byte order: every multi-byte field on the wire is big-endian (network
 * order), hence the __be types. The constants below are in HOST order:
 * compare with bpf_htons()/bpf_htonl() (e.g.
 * `hdr->magic == bpf_htons(TCPMIG_MAGIC)`).
 *
 * Types: only fixed-width kernel types, no libc. If your program already has
 * __u8.. / __be16.. (e.g. from vmlinux.h), define CAPYBARA_PROTO_HAVE_TYPES
 * before including this header so that <linux/types.h> is not pulled in.
 *
 * Full byte-by-byte documentation: docs/TCPMIG.md.
 */
#ifndef CAPYBARA_PROTO_H
#define CAPYBARA_PROTO_H

#ifndef CAPYBARA_PROTO_HAVE_TYPES
#include <linux/types.h>
#endif

/* ------------------------------------------------------------------------ */
/* UDP ports                                                                */
/* ------------------------------------------------------------------------ */

/* TCPMig: between server data addresses, through the switch. PREPARE is
 * addressed to the switch (server-side address), which picks the target. */
#define CAPYBARA_PORT_TCPMIG 7690
/* LOAD-NOTIFICATION: switch -> server data address. */
#define CAPYBARA_PORT_LOAD 7691
/* Control channel: server -> switch management address (and replies). */
#define CAPYBARA_PORT_CONTROL 7692

/* ------------------------------------------------------------------------ */
/* TCPMig (UDP payload)                                                     */
/* ------------------------------------------------------------------------ */

#define TCPMIG_MAGIC 0xCA9B
/* 2: the 8-byte ownership epoch follows `reason` (v1 headers were 44 bytes). */
#define TCPMIG_VERSION 2

/* kind */
#define TCPMIG_KIND_PREPARE 1
#define TCPMIG_KIND_PREPARE_ACK 2
#define TCPMIG_KIND_CONN_STATE 3
#define TCPMIG_KIND_CONN_STATE_ACK 4
#define TCPMIG_KIND_REJECT 5
#define TCPMIG_KIND_ABORT 6

/* reason (REJECT / ABORT; 0 in every other kind). Unknown codes must be
 * accepted by receivers and treated like TCPMIG_REASON_UNSPECIFIED. */
#define TCPMIG_REASON_NONE 0
#define TCPMIG_REASON_NO_CAPACITY 1      /* target has no room (buffers, conns) */
#define TCPMIG_REASON_DRAINING 2         /* target is draining                  */
#define TCPMIG_REASON_POLICY 3           /* refused by policy (anti-thrash...)  */
#define TCPMIG_REASON_TIMEOUT 4          /* a phase timed out                   */
#define TCPMIG_REASON_UNKNOWN_MIGRATION 5 /* message for a migration not known  */
#define TCPMIG_REASON_IMPORT_FAILED 6    /* snapshot could not be imported      */
#define TCPMIG_REASON_DUPLICATE_FLOW 7   /* target already holds this flow      */
#define TCPMIG_REASON_CANCELLED 8        /* origin gave up (conn closed, ...)   */
#define TCPMIG_REASON_SNAPSHOT_TOO_LARGE 9 /* origin's snapshot over its limit */
#define TCPMIG_REASON_UNSPECIFIED 0xFFFF

/* Lengths. A datagram is header + payload_len bytes of payload + MAC. */
#define TCPMIG_HDR_LEN 52
#define TCPMIG_MAC_LEN 16
#define TCPMIG_MIN_LEN (TCPMIG_HDR_LEN + TCPMIG_MAC_LEN)

/* Byte offsets inside the UDP payload (same as offsetof(struct tcpmig_hdr)). */
#define TCPMIG_OFF_MAGIC 0
#define TCPMIG_OFF_VERSION 2
#define TCPMIG_OFF_KIND 3
#define TCPMIG_OFF_MIGRATION_ID 4
#define TCPMIG_OFF_CLIENT_IP 12
#define TCPMIG_OFF_CLIENT_PORT 16
#define TCPMIG_OFF_SERVICE_PORT 18
#define TCPMIG_OFF_SERVICE_IP 20
#define TCPMIG_OFF_ORIGIN 24
#define TCPMIG_OFF_TARGET 28
#define TCPMIG_OFF_SEQ 32
#define TCPMIG_OFF_FRAG_INDEX 36
#define TCPMIG_OFF_FRAG_COUNT 38
#define TCPMIG_OFF_PAYLOAD_LEN 40
#define TCPMIG_OFF_REASON 42
#define TCPMIG_OFF_EPOCH 44
#define TCPMIG_OFF_PAYLOAD 52

/*
 * The 52-byte TCPMig header (v2). The switch reads it (kind, flow, target) but
 * NEVER writes it: the MAC covers header + payload and the switch has no key.
 * For PREPARE it rewrites only the IP/UDP destination and Ethernet addresses;
 * on PREPARE_ACK (target -> origin) it installs the migration-table entry
 * flow -> target, then forwards.
 * Packed because migration_id sits at offset 4 (not 8-aligned).
 */
struct tcpmig_hdr {
	__be16 magic;        /* TCPMIG_MAGIC                                    */
	__u8 version;        /* TCPMIG_VERSION; others are counted and dropped */
	__u8 kind;           /* TCPMIG_KIND_*                                   */
	__be64 migration_id; /* chosen by the origin, unique per migration      */
	__be32 client_ip;    /* flow as the client sees it                      */
	__be16 client_port;
	__be16 service_port;
	__be32 service_ip;   /* the VIP                                         */
	__be32 origin;       /* data address of the origin server               */
	__be32 target;       /* data address of the target; 0 in PREPARE = switch chooses */
	__be32 seq;          /* per-migration message sequence number           */
	__be16 frag_index;   /* CONN_STATE fragment index (0 otherwise)         */
	__be16 frag_count;   /* CONN_STATE fragment count (1 otherwise)         */
	__be16 payload_len;  /* bytes of payload after this header              */
	__be16 reason;       /* TCPMIG_REASON_* for REJECT/ABORT, 0 otherwise   */
	__be64 epoch;        /* v2: id of the migration that gave the origin the
	                      * flow (0: its placement); the switch installs a
	                      * PREPARE_ACK over a final entry only if the entry's
	                      * id equals it (or is an older id of the origin)   */
} __attribute__((packed));

_Static_assert(sizeof(struct tcpmig_hdr) == TCPMIG_HDR_LEN, "tcpmig_hdr size");

/* ------------------------------------------------------------------------ */
/* LOAD-NOTIFICATION (UDP payload, switch -> server data address, 7691)     */
/* ------------------------------------------------------------------------ */

#define LOAD_MAGIC 0xCA9C
#define LOAD_VERSION 1
#define LOAD_LEN 48
/* Version 2: the 48 bytes of version 1 (version 2), then own_weight and
 * pool_weight (__be32 each); sent while the pool's weights differ. */
#define LOAD_VERSION_WEIGHTED 2
#define LOAD_LEN_WEIGHTED 56
#define LOAD_OFF_OWN_WEIGHT 48
#define LOAD_OFF_POOL_WEIGHT 52

#define LOAD_OFF_MAGIC 0
#define LOAD_OFF_VERSION 2
#define LOAD_OFF_FLAGS 3
#define LOAD_OFF_EPOCH 4
#define LOAD_OFF_SEQUENCE 8
#define LOAD_OFF_INTERVAL_US 16
#define LOAD_OFF_SERVER_ID 20
#define LOAD_OFF_OWN_LOAD 24
#define LOAD_OFF_POOL_LOAD 32
#define LOAD_OFF_LIVE_SERVERS 40
#define LOAD_OFF_LEAST_LOADED 44

/*
 * One load report per server per interval. Not MAC'd: only the switch's
 * server-side port emits it and the worst a forged one can do is make a
 * server shed or keep load (see docs/TCPMIG.md). Naturally aligned (every
 * field sits at a multiple of its size), packed only to forbid padding.
 */
struct load_notification {
	__be16 magic;        /* LOAD_MAGIC                                            */
	__u8 version;        /* LOAD_VERSION                                          */
	__u8 flags;          /* reserved, 0                                           */
	__be32 epoch;        /* switch epoch: changes on switchd restart/takeover    */
	__be64 sequence;     /* notification number within the epoch                 */
	__be32 interval_us;  /* length of the measured interval                       */
	__be32 server_id;    /* the receiving server                                  */
	__be64 own_load;     /* packets to this server during the interval            */
	__be64 pool_load;    /* packets to all live servers during the interval       */
	__be32 live_servers; /* number of live servers in the pool                    */
	__be32 least_loaded; /* data address of the least-loaded server (reference)  */
} __attribute__((packed));

_Static_assert(sizeof(struct load_notification) == LOAD_LEN, "load_notification size");

/* ------------------------------------------------------------------------ */
/* Control channel (UDP payload, 7692). Handled in user space only; the     */
/* layout is here so that the data plane can recognise and pass it.         */
/* ------------------------------------------------------------------------ */

#define CONTROL_MAGIC 0xCA9D
#define CONTROL_VERSION 1
#define CONTROL_HDR_LEN 20
#define CONTROL_MAC_LEN 16

#define CONTROL_KIND_REGISTER 1
#define CONTROL_KIND_REGISTER_ACK 2
#define CONTROL_KIND_HEARTBEAT 3
#define CONTROL_KIND_DRAIN 4
#define CONTROL_KIND_MIGRATE 5
#define CONTROL_KIND_ERROR 6
#define CONTROL_KIND_SET_OWNER 7
#define CONTROL_KIND_POLICY 8
#define CONTROL_KIND_MIGRATION_REPORT 9

#define CONTROL_OFF_MAGIC 0
#define CONTROL_OFF_VERSION 2
#define CONTROL_OFF_KIND 3
#define CONTROL_OFF_SERVER_ID 4
#define CONTROL_OFF_SEQ 8
#define CONTROL_OFF_BODY_LEN 16
#define CONTROL_OFF_FLAGS 18
#define CONTROL_OFF_BODY 20

struct control_hdr {
	__be16 magic;     /* CONTROL_MAGIC                                   */
	__u8 version;     /* CONTROL_VERSION                                 */
	__u8 kind;        /* CONTROL_KIND_*                                  */
	__be32 server_id; /* server the message is from / about              */
	__be64 seq;       /* sender's sequence number (replay, correlation)  */
	__be16 body_len;  /* bytes of body after this header                 */
	__be16 flags;     /* reserved, 0                                     */
} __attribute__((packed));

_Static_assert(sizeof(struct control_hdr) == CONTROL_HDR_LEN, "control_hdr size");

#endif /* CAPYBARA_PROTO_H */
