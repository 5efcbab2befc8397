// SPDX-License-Identifier: Apache-2.0
/*
 * switch.bpf.c: the Capybara switch data plane (XDP).
 *
 * Attached to every switch interface. Client side: packets to a VIP:port
 * are placed (new flow), or sent to their current owner (migration table
 * first, then flow table), with the destination rewritten to the server's
 * data address. Server side: TCPMig PREPARE is steered to a target taken
 * from the control plane's target ring (retransmissions to the same target);
 * PREPARE-ACK installs a pending migration-table entry toward the target,
 * CONN_STATE_ACK makes it final, the target's ABORT decision points it back
 * at the origin (docs/MIGRATION.md, "What the switch must do").
 * Everything else (server responses from the VIP, ARP, control channel)
 * goes to the kernel (XDP_PASS), which routes it.
 *
 * Untrusted input: every header is bounds-checked before it is read, and
 * every verdict increments exactly one reason counter in `stats`. The
 * program never writes TCPMig bytes (they are MAC'd by the servers).
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "capybara_proto.h"
#include "capybara_maps.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define IP_FRAG_MASK 0x3fff /* MF flag + fragment offset */

static __always_inline int verdict(__u32 reason, int action)
{
	__u64 *c = bpf_map_lookup_elem(&stats, &reason);

	if (c)
		*c += 1;
	return action;
}

static __always_inline void count_only(__u32 reason)
{
	verdict(reason, 0);
}

/* murmur3 finaliser; identical to src/maglev.rs::mix32. */
static __always_inline __u32 mix32(__u32 h)
{
	h ^= h >> 16;
	h *= 0x85ebca6bu;
	h ^= h >> 13;
	h *= 0xc2b2ae35u;
	h ^= h >> 16;
	return h;
}

/* Flow hash for Maglev; identical to src/maglev.rs::flow_hash. Host-order
 * values so that user space computes it from a FlowKey without caring how
 * the key is laid out in memory. */
static __always_inline __u32 flow_hash(const struct capy_flow_key *k)
{
	__u32 h = CAPY_HASH_SEED;

	h = mix32(h ^ bpf_ntohl(k->client_ip));
	h = mix32(h ^ (((__u32)bpf_ntohs(k->client_port) << 16) | bpf_ntohs(k->service_port)));
	h = mix32(h ^ bpf_ntohl(k->service_ip));
	return h;
}

/* RFC 1624 incremental update of a one's-complement checksum for a 32-bit
 * field change. Works on raw (network-order) values: the one's-complement
 * sum is byte-order independent as long as all operands agree. */
static __always_inline __u16 csum_replace4(__u16 check, __u32 from, __u32 to)
{
	__u32 sum = (__u16)~check;

	sum += (~from >> 16) & 0xffff;
	sum += ~from & 0xffff;
	sum += to >> 16;
	sum += to & 0xffff;
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return (__u16)~sum;
}

/* One's-complement sum of the 10 16-bit words at `w` (an IPv4 or TCP header
 * without options), added to `sum`, in memory order like the header. */
static __always_inline __u32 csum_10_words(const __u16 *w, __u32 sum)
{
#pragma unroll
	for (int i = 0; i < 10; i++)
		sum += w[i];
	return sum;
}

static __always_inline __u16 csum_fold(__u32 sum)
{
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return (__u16)~sum;
}

/* A client segment that no flow owns, to a retiring (deleted) service
 * (`reason` CAPY_STAT_RESET_RETIRED), or a SYN to a service whose every
 * server is out for a lasting reason (CAPY_SVC_REFUSE,
 * CAPY_STAT_RESET_NO_SERVER): the VIP:port answers as a host does for a
 * closed port (RFC 9293 3.10.7.1), a reset back out the interface it came in
 * (XDP_TX), so that the client fails at once ("connection refused") instead
 * of retrying its SYN for minutes. <SEQ=SEG.ACK><RST>
 * for a segment with ACK, else <SEQ=0><ACK=SEG.SEQ+SEG.LEN><RST,ACK>. A
 * reset is never answered. The frame is rewritten in place to Ethernet +
 * IPv4 (no options) + TCP (no options, no payload): every field is read
 * before the first write. `tcp` is bounds-checked, and its header length
 * checked against the IP total length, by the caller. */
static __always_inline int reset_client(struct xdp_md *ctx, struct ethhdr *eth, struct iphdr *ip,
					struct tcphdr *tcp, __u32 reason)
{
	__u8 client_mac[ETH_ALEN], our_mac[ETH_ALEN];
	__be32 client = ip->saddr, vip = ip->daddr;
	__be16 cport = tcp->source, vport = tcp->dest;
	__u32 seg_len, seq, ack, sum;
	int with_ack = tcp->ack;
	void *data, *data_end;
	int len, want;

	if (tcp->rst)
		return verdict(CAPY_STAT_PASS_NOT_SERVICE, XDP_PASS);
	seg_len = bpf_ntohs(ip->tot_len) - ip->ihl * 4 - tcp->doff * 4 + tcp->syn + tcp->fin;
	seq = with_ack ? bpf_ntohl(tcp->ack_seq) : 0;
	ack = bpf_ntohl(tcp->seq) + seg_len;
	__builtin_memcpy(client_mac, eth->h_source, ETH_ALEN);
	__builtin_memcpy(our_mac, eth->h_dest, ETH_ALEN);

	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	len = data_end - data;
	want = sizeof(struct ethhdr) + sizeof(struct iphdr) + sizeof(struct tcphdr);
	if (len > want && bpf_xdp_adjust_tail(ctx, want - len))
		return verdict(CAPY_STAT_PASS_NOT_SERVICE, XDP_PASS);
	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	eth = data;
	ip = (void *)(eth + 1);
	tcp = (void *)(ip + 1);
	if ((void *)(tcp + 1) > data_end)
		return verdict(CAPY_STAT_DROP_SHORT_L4, XDP_DROP);

	__builtin_memcpy(eth->h_dest, client_mac, ETH_ALEN);
	__builtin_memcpy(eth->h_source, our_mac, ETH_ALEN);
	eth->h_proto = bpf_htons(ETH_P_IP);

	__builtin_memset(ip, 0, sizeof(*ip));
	ip->version = 4;
	ip->ihl = 5;
	ip->tot_len = bpf_htons(sizeof(struct iphdr) + sizeof(struct tcphdr));
	ip->frag_off = bpf_htons(0x4000); /* DF */
	ip->ttl = 64;
	ip->protocol = IPPROTO_TCP;
	ip->saddr = vip;
	ip->daddr = client;
	ip->check = csum_fold(csum_10_words((__u16 *)ip, 0));

	__builtin_memset(tcp, 0, sizeof(*tcp));
	tcp->source = vport;
	tcp->dest = cport;
	tcp->seq = bpf_htonl(seq);
	tcp->doff = 5;
	tcp->rst = 1;
	if (!with_ack) {
		tcp->ack_seq = bpf_htonl(ack);
		tcp->ack = 1;
	}
	/* Pseudo-header: addresses, protocol and TCP length, in memory order. */
	sum = (vip & 0xffff) + (vip >> 16) + (client & 0xffff) + (client >> 16) +
	      bpf_htons(IPPROTO_TCP) + bpf_htons(sizeof(struct tcphdr));
	tcp->check = csum_fold(csum_10_words((__u16 *)tcp, sum));
	return verdict(reason, XDP_TX);
}

static __always_inline void emit_event(const struct capy_flow_key *key, __u32 kind,
				       __u32 server, __u32 prev)
{
	struct capy_flow_event *e;

	e = bpf_ringbuf_reserve(&flow_events, sizeof(*e), 0);
	if (!e) {
		/* Persistence must never stall the packet path. */
		count_only(CAPY_STAT_EVENT_LOST);
		return;
	}
	e->key = *key;
	e->kind = kind;
	e->server = server;
	e->prev_server = prev;
	e->ts_ns = bpf_ktime_get_ns();
	/* User space drains on a timer, so skip the per-event wakeup. */
	bpf_ringbuf_submit(e, BPF_RB_NO_WAKEUP);
}

/* Server at position `attempt` (0 or 1) of a ring pushed by the control
 * plane: the next one in rotation, or the first/second entry for a
 * preference-ordered ring. For a paired ring, attempt 0 takes the next
 * pair's target and attempt 1 the alternate of the pair attempt 0 took
 * (`*pair`, set by attempt 0). -1 if empty. */
static __always_inline int ring_pick(__u32 ring, __u32 attempt, __u32 *pair, __u32 *out)
{
	struct capy_ring *r = bpf_map_lookup_elem(&rings, &ring);
	__u64 *cur = bpf_map_lookup_elem(&ring_cursors, &ring);
	__u32 len, i;

	if (!r || !cur)
		return -1;
	len = r->len;
	if (len == 0 || len > CAPY_RING_SIZE)
		return -1;
	if (r->mode == CAPY_RING_FIRST) {
		i = attempt < len ? attempt : len - 1;
	} else if (r->mode == CAPY_RING_PAIRED) {
		if (len < 2)
			return -1;
		if (attempt == 0)
			*pair = (__u32)__sync_fetch_and_add(cur, 1) % (len / 2);
		i = 2 * *pair + (attempt ? 1 : 0);
	} else {
		i = (__u32)__sync_fetch_and_add(cur, 1) % len;
	}
	/* No-op (i < len <= CAPY_RING_SIZE, a power of two) that the
	 * verifier can see as a bound. */
	asm volatile("" : "+r"(i)); /* keep clang from folding the mask away */
	i &= CAPY_RING_SIZE - 1;
	*out = r->servers[i];
	return 0;
}

/* Rewrite Ethernet to reach `srv` and hand the frame to its port. Falls back
 * to the kernel (which routes the data address the same way) if the port is
 * missing from tx_ports. */
static __always_inline int forward_l2(struct ethhdr *eth, const struct capy_server *srv)
{
	__builtin_memcpy(eth->h_dest, srv->mac, ETH_ALEN);
	__builtin_memcpy(eth->h_source, srv->src_mac, ETH_ALEN);
	return bpf_redirect_map(&tx_ports, srv->ifindex, XDP_PASS);
}

static __always_inline int usable_owner(const struct capy_server *srv)
{
	return srv && (srv->state == CAPY_SERVER_LIVE || srv->state == CAPY_SERVER_DRAINING);
}

/* ------------------------------------------------------------------------ */
/* Client -> VIP (TCP)                                                      */
/* ------------------------------------------------------------------------ */

/* A FIN seen one way (`side` = CAPY_FLOW_FIN_CLIENT or _SERVER). The flow
 * closes only when both directions have sent their FIN: after the client's
 * FIN alone the server may stream for a long time (a half-closed echo or
 * download), and reaping a migrated flow's entry then would steer the
 * client's ACKs to the flow's original server, which resets them. */
static __always_inline void note_fin(const struct capy_flow_key *key, struct capy_flow *flow, __u16 side,
				     __u32 server)
{
	flow->flags |= side;
	if ((flow->flags & (CAPY_FLOW_FIN_CLIENT | CAPY_FLOW_FIN_SERVER)) ==
		    (CAPY_FLOW_FIN_CLIENT | CAPY_FLOW_FIN_SERVER) &&
	    !(flow->flags & CAPY_FLOW_CLOSING)) {
		flow->flags |= CAPY_FLOW_CLOSING;
		emit_event(key, CAPY_EV_CLOSED, server, server);
	}
}

/* No usable server for a flow without entry: a SYN to a service the control
 * plane marked CAPY_SVC_REFUSE is refused with a reset; anything else is
 * dropped as before (a non-SYN is no new connection; without the flag the
 * lack of a server may last a moment only, and the client's retransmitted
 * SYN may then be placed). */
static __always_inline int no_server(struct xdp_md *ctx, struct ethhdr *eth, struct iphdr *ip,
				     struct tcphdr *tcp, const struct capy_service *svc, int syn_only)
{
	if (syn_only && !tcp->rst && (svc->flags & CAPY_SVC_REFUSE))
		return reset_client(ctx, eth, ip, tcp, CAPY_STAT_RESET_NO_SERVER);
	return verdict(CAPY_STAT_DROP_NO_SERVER, XDP_DROP);
}

static __always_inline int handle_tcp(struct xdp_md *ctx, struct ethhdr *eth, struct iphdr *ip,
				      struct tcphdr *tcp, const struct capy_service *svc)
{
	struct capy_flow_key key = {
		.client_ip = ip->saddr,
		.service_ip = ip->daddr,
		.client_port = tcp->source,
		.service_port = tcp->dest,
	};
	int syn_only = tcp->syn && !tcp->ack;
	__u32 server, reason;
	struct capy_migration *mig;
	struct capy_flow *flow;
	struct capy_server *srv;

	mig = bpf_map_lookup_elem(&migrations, &key);
	if (mig && syn_only) {
		/* A SYN without ACK is no segment of a migrated connection's
		 * (migrations start after the handshake; at most a late duplicate
		 * of its first one). On a closed tuple it starts a new connection,
		 * and the migration entry is the old connection's: its flow is
		 * CLOSING (FINs both ways), or has no entry: the client's
		 * reset removed both, and a TCPMig message of a migration then in
		 * flight (a PREPARE_ACK, an ABORT decision) made a migration entry
		 * again. Following it made no flow entry of the new connection's
		 * own (or kept it CLOSING), and the control plane's reaper, queued
		 * by the old close, removed its entries closed_linger later: its
		 * segments were dropped, or placed anew on a server without it.
		 * The new flow gets its own entry (flags 0) on the old
		 * connection's last owner (a final entry's server) while it is
		 * live: whatever is left of the old connection (TIME-WAIT, or a
		 * state imported after the client's reset) is there, and TCP
		 * settles the SYN against it instead of leaving it orphaned (a
		 * server the connection left serves such a SYN too:
		 * docs/MIGRATION.md). Otherwise, or when the entry is pending (its
		 * target imported nothing and would buffer the SYN for an import
		 * that may never complete), the flow is placed anew. An open flow
		 * (not CLOSING) keeps following its owner: the SYN is a duplicate
		 * of its own, or the client lost a connection whose end the switch
		 * did not see, and the owner holding it answers (RFC 9293
		 * 3.10.7.4: a challenge ACK, the client's reset, which removes the
		 * entries, then its SYN again, placed afresh). */
		flow = bpf_map_lookup_elem(&flows, &key);
		if (!flow || (flow->flags & CAPY_FLOW_CLOSING)) {
			__u32 last = mig->server;
			int pending = mig->pending;

			bpf_map_delete_elem(&migrations, &key);
			mig = NULL;
			srv = pending ? NULL : bpf_map_lookup_elem(&servers, &last);
			if (srv && srv->state == CAPY_SERVER_LIVE && svc->placement != CAPY_PLACE_NONE) {
				struct capy_flow nf = { .server = last,
							.service = (__u16)svc->index,
							.flags = CAPY_FLOW_UNPREPARED,
							.created_ns = bpf_ktime_get_ns() };

				bpf_map_update_elem(&flows, &key, &nf, BPF_ANY);
				emit_event(&key, CAPY_EV_NEW, last, last);
				server = last;
				reason = CAPY_STAT_FWD_NEW_FLOW;
				goto rewrite;
			}
		}
	}
	if (mig) {
		server = mig->server;
		reason = CAPY_STAT_FWD_MIGRATED;
		if (tcp->rst) {
			/* Client reset: the connection is gone wherever it lives. */
			emit_event(&key, CAPY_EV_CLOSED, server, server);
			bpf_map_delete_elem(&migrations, &key);
			bpf_map_delete_elem(&flows, &key);
		} else if (tcp->fin) {
			flow = bpf_map_lookup_elem(&flows, &key);
			if (flow)
				note_fin(&key, flow, CAPY_FLOW_FIN_CLIENT, server);
			/* The migration entry stays until the last ACK is through;
			 * the control plane reaps it after the CLOSED event. */
		}
		goto forward;
	}

	flow = bpf_map_lookup_elem(&flows, &key);
	if (flow && !(syn_only && (flow->flags & CAPY_FLOW_CLOSING))) {
		server = flow->server;
		reason = CAPY_STAT_FWD_ESTABLISHED;
		/* The client's first non-SYN segment (its handshake ACK): no
		 * longer embryonic. Written once, not per packet. */
		if (!syn_only && !(flow->flags & CAPY_FLOW_ESTABLISHED))
			flow->flags |= CAPY_FLOW_ESTABLISHED;
		if (tcp->rst) {
			emit_event(&key, CAPY_EV_CLOSED, server, server);
			bpf_map_delete_elem(&flows, &key);
		} else if (tcp->fin) {
			note_fin(&key, flow, CAPY_FLOW_FIN_CLIENT, server);
		}
		goto forward;
	}

	/* No entry (or a SYN reusing a closed 4-tuple): place the flow. A
	 * retiring (deleted) service places nothing: a reset answers. */
	if (svc->placement == CAPY_PLACE_NONE)
		return reset_client(ctx, eth, ip, tcp, CAPY_STAT_RESET_RETIRED);
	if (svc->placement == CAPY_PLACE_MAGLEV) {
		__u32 slot = svc->index * CAPY_MAGLEV_SIZE + flow_hash(&key) % CAPY_MAGLEV_SIZE;
		__u32 *s = bpf_map_lookup_elem(&maglev, &slot);

		if (!s)
			return no_server(ctx, eth, ip, tcp, svc, syn_only);
		server = *s;
		/* A non-SYN without entry (switch restart, LRU eviction) lands
		 * where Maglev put it originally as long as the pool is stable. */
		reason = syn_only ? CAPY_STAT_FWD_NEW_FLOW : CAPY_STAT_FWD_RECOVERED;
	} else {
		__u32 pair = 0;

		/* Ring placement is not reproducible without state. */
		if (!syn_only)
			return verdict(CAPY_STAT_DROP_NO_FLOW, XDP_DROP);
		if (ring_pick(svc->index * CAPY_RING_KINDS + CAPY_RING_PLACEMENT, 0, &pair, &server) < 0)
			return no_server(ctx, eth, ip, tcp, svc, syn_only);
		reason = CAPY_STAT_FWD_NEW_FLOW;
	}
	srv = bpf_map_lookup_elem(&servers, &server);
	if (!srv || srv->state != CAPY_SERVER_LIVE)
		return no_server(ctx, eth, ip, tcp, svc, syn_only);
	{
		/* A recovered flow (non-SYN without entry) already carries the
		 * client's non-SYN segment: established. When its server does
		 * not know the connection (its hostagent restarted), the server's
		 * reset removes the entry (note_server_rst). */
		struct capy_flow nf = { .server = server,
					.service = (__u16)svc->index,
					.flags = syn_only ? CAPY_FLOW_UNPREPARED : CAPY_FLOW_ESTABLISHED,
					.created_ns = bpf_ktime_get_ns() };

		bpf_map_update_elem(&flows, &key, &nf, BPF_ANY);
		emit_event(&key, CAPY_EV_NEW, server, server);
	}
	goto rewrite;

forward:
	srv = bpf_map_lookup_elem(&servers, &server);
	if (!usable_owner(srv))
		return verdict(CAPY_STAT_DROP_SERVER_DOWN, XDP_DROP);
rewrite:
	{
		__be32 new_dst = srv->data_ip;
		struct capy_server_stats *st = bpf_map_lookup_elem(&server_stats, &server);

		ip->check = csum_replace4(ip->check, ip->daddr, new_dst);
		tcp->check = csum_replace4(tcp->check, ip->daddr, new_dst);
		ip->daddr = new_dst;
		if (st) {
			__u32 len = bpf_ntohs(ip->tot_len);

			st->packets += 1;
			st->bytes += len;
			if (len > (__u32)ip->ihl * 4 + (__u32)tcp->doff * 4)
				st->requests += 1;
		}
		count_only(reason);
		return forward_l2(eth, srv);
	}
}

/* ------------------------------------------------------------------------ */
/* TCPMig (server side)                                                     */
/* ------------------------------------------------------------------------ */

static __always_inline int lookup_server_idx(__be32 addr, __u32 *idx)
{
	__u32 *p = bpf_map_lookup_elem(&server_by_addr, &addr);

	if (!p)
		return -1;
	*idx = *p;
	return 0;
}

/* Point the datagram at `srv`'s data address and forward it. */
static __always_inline int send_to_server(struct ethhdr *eth, struct iphdr *ip, struct udphdr *udp,
					  const struct capy_server *srv)
{
	__be32 new_dst = srv->data_ip;

	if (ip->daddr != new_dst) {
		ip->check = csum_replace4(ip->check, ip->daddr, new_dst);
		/* UDP checksum 0 means "none" and must stay 0; a computed 0 is
		 * sent as 0xffff (RFC 768). */
		if (udp->check) {
			__u16 c = csum_replace4(udp->check, ip->daddr, new_dst);

			udp->check = c ? c : 0xffff;
		}
		ip->daddr = new_dst;
	}
	return forward_l2(eth, srv);
}

static __always_inline __u64 mig_id(const struct tcpmig_hdr *m)
{
	return bpf_be64_to_cpu(m->migration_id);
}

/* TCPMig v2: migration `id` from `origin` with ownership epoch `epoch` (the
 * id of the migration that gave the origin the flow, 0 for its placement)
 * may take over a flow whose entry is `e`: the entry is final, on the
 * origin, of another migration, and its id is the epoch or an older id of
 * the origin itself (its own aborted migrations since). A PREPARE_ACK
 * delayed past later migrations of the flow names an epoch the entry has
 * moved on from.
 *
 * Or the entry is still pending toward the origin for the epoch itself:
 * the origin owns the flow through that migration, which therefore
 * committed (a target commits on import and sends CONN_STATE_ACK, never
 * aborts after), though its CONN_STATE_ACK has not passed this program
 * (lost or delayed, or it passed the predecessor's program during a
 * takeover in place). Without this, such an entry stayed pending until
 * that ACK came, for good if it never would, every later migration of the
 * flow refused as stale. */
static __always_inline int mig_supersedes(const struct capy_migration *e, __u32 origin, __u64 id,
					  __u64 epoch)
{
	__u64 oid = e->migration_id;

	/* "Older" in serial-number arithmetic (RFC 1982) on the counter: a
	 * hostagent seeds it from the wall clock (milliseconds), so it wraps
	 * every ~49.7 days and a restarted process continues above the ids of
	 * the one before. */
	if (e->server != origin || oid == id)
		return 0;
	if (e->pending)
		return oid == epoch;
	return oid == epoch || ((oid >> 32) == (id >> 32) && (__s32)((__u32)id - (__u32)oid) > 0);
}

/* Remembers the outcome of migration `id` (the final entry {owner, id} it
 * makes) that this program could not apply: no pending entry of it here
 * (unmatched_outcomes, read by switchd at a takeover's end). */
static __always_inline void note_unmatched_outcome(const struct capy_migration *e, __u64 id, __u32 owner)
{
	struct capy_migration out = { .server = owner, .pending = CAPY_MIG_FINAL, .migration_id = id };

	if (e && e->migration_id == id)
		return; /* a duplicate of an outcome applied here */
	bpf_map_update_elem(&unmatched_outcomes, &id, &out, BPF_ANY);
}

/* Without a migration entry the owner of `flow` is its placement: a
 * migration from `origin` may take it (PREPARE_ACK) or settle it
 * (CONN_STATE_ACK) only if it is placed there, and, for a flow the program
 * made for a client's SYN, only once a PREPARE of the flow has passed
 * (CAPY_FLOW_UNPREPARED: else the message is a closed connection's, late,
 * on a reused 4-tuple). */
static __always_inline int placed_on_origin(const struct capy_flow *flow, __u32 origin)
{
	return flow->server == origin && !(flow->flags & CAPY_FLOW_UNPREPARED);
}

static __always_inline struct capy_flow_key mig_flow_key(const struct tcpmig_hdr *m)
{
	struct capy_flow_key key = {
		.client_ip = m->client_ip,
		.service_ip = m->service_ip,
		.client_port = m->client_port,
		.service_port = m->service_port,
	};
	return key;
}

/* Writes {server, pending, id} for `key`; `flags` BPF_ANY / BPF_NOEXIST. */
static __always_inline long put_migration(const struct capy_flow_key *key, __u32 server, __u8 pending,
					  __u64 id, __u64 flags)
{
	struct capy_migration nm = { .server = server, .pending = pending, .migration_id = id };

	return bpf_map_update_elem(&migrations, key, &nm, flags);
}

/* Remembers `id` as the last migration id of the registered origin `addr`
 * (origin_ids) when it is newer in serial-number arithmetic than the one
 * remembered, or of another origin (not addr << 32: ignored). Two CPUs may
 * race and leave the older of two concurrent ids: the hostagent starts a
 * margin above the value it is told. */
static __always_inline void note_origin_id(__be32 addr, __u64 id)
{
	__u64 *last;

	if ((__u32)(id >> 32) != bpf_ntohl(addr))
		return;
	last = bpf_map_lookup_elem(&origin_ids, &addr);
	if (!last) {
		bpf_map_update_elem(&origin_ids, &addr, &id, BPF_NOEXIST);
		return;
	}
	if ((__s32)((__u32)id - (__u32)*last) > 0)
		*last = id;
}

static __always_inline int handle_prepare(struct ethhdr *eth, struct iphdr *ip, struct udphdr *udp,
					  struct tcpmig_hdr *m)
{
	struct capy_service_key sk = { .vip = m->service_ip, .port = m->service_port, .proto = IPPROTO_TCP };
	struct capy_service *svc;
	struct capy_server *srv = NULL;
	__u32 target, origin = (__u32)-1;
	__u64 id = mig_id(m);
	__u32 *mem;

	if (lookup_server_idx(m->origin, &origin) == 0)
		note_origin_id(m->origin, id);
	{
		/* The flow's PREPARE: its PREPARE_ACK may take it (see
		 * CAPY_FLOW_UNPREPARED). Written once per connection. */
		struct capy_flow_key fk = mig_flow_key(m);
		struct capy_flow *fl = bpf_map_lookup_elem(&flows, &fk);

		if (fl && (fl->flags & CAPY_FLOW_UNPREPARED))
			fl->flags &= ~CAPY_FLOW_UNPREPARED;
	}
	if (m->target) {
		/* The origin named its target: honoured, unless it is not a
		 * server that can hold a connection. */
		if (lookup_server_idx(m->target, &target) < 0)
			return verdict(CAPY_STAT_DROP_TCPMIG_UNKNOWN, XDP_DROP);
		srv = bpf_map_lookup_elem(&servers, &target);
		if (!usable_owner(srv))
			return verdict(CAPY_STAT_DROP_TCPMIG_NO_TARGET, XDP_DROP);
		count_only(CAPY_STAT_FWD_PREPARE);
		return send_to_server(eth, ip, udp, srv);
	}

	/* Every retransmission of one migration goes to the target its first
	 * PREPARE went to (the target dedups by id; another target would
	 * answer a second PREPARE_ACK for the same migration). */
	mem = bpf_map_lookup_elem(&prepare_targets, &id);
	if (mem) {
		target = *mem;
		srv = bpf_map_lookup_elem(&servers, &target);
		if (target == origin || !usable_owner(srv))
			srv = NULL;
	}
	if (!srv) {
		__u32 pair = 0;
		int tries;

		svc = bpf_map_lookup_elem(&services, &sk);
		if (!svc)
			return verdict(CAPY_STAT_DROP_TCPMIG_NO_TARGET, XDP_DROP);
		/* The ring holds live, non-draining servers only (control plane);
		 * skip the origin, which may be in it. Two tries suffice: the
		 * control plane never puts the origin twice in a row, and a
		 * paired ring's alternate is never its pair's target. */
		for (tries = 0; tries < 2; tries++) {
			if (ring_pick(svc->index * CAPY_RING_KINDS + CAPY_RING_TARGET, tries, &pair, &target) < 0)
				return verdict(CAPY_STAT_DROP_TCPMIG_NO_TARGET, XDP_DROP);
			if (target != origin)
				break;
		}
		if (target == origin)
			return verdict(CAPY_STAT_DROP_TCPMIG_NO_TARGET, XDP_DROP);
		srv = bpf_map_lookup_elem(&servers, &target);
		if (!srv || srv->state != CAPY_SERVER_LIVE)
			return verdict(CAPY_STAT_DROP_TCPMIG_NO_TARGET, XDP_DROP);
		bpf_map_update_elem(&prepare_targets, &id, &target, BPF_ANY);
	}
	count_only(CAPY_STAT_FWD_PREPARE);
	return send_to_server(eth, ip, udp, srv);
}

/* PREPARE_ACK(M, origin o, target t): the target reserved its buffers; from
 * now on the client's segments must reach t (it buffers them). Installs
 * {t, M, pending} iff there is no entry (and o is the placement), or
 * mig_supersedes() (the entry is final on o and is o's ownership epoch, or
 * an older id of o: ids of one origin increase). A duplicate of the installing ACK is forwarded;
 * anything else (stale ACK, or the flow is mid-migration) is dropped. */
static __always_inline int handle_prepare_ack(struct ethhdr *eth, struct iphdr *ip, struct udphdr *udp,
					      struct tcpmig_hdr *m)
{
	struct capy_flow_key key = mig_flow_key(m);
	__be32 target_addr = m->target ? m->target : ip->saddr;
	__u64 id = mig_id(m);
	__u32 target, origin;
	struct capy_migration *old;
	struct capy_flow *flow;
	struct capy_server *osrv;
	long err;

	if (lookup_server_idx(target_addr, &target) < 0 || lookup_server_idx(m->origin, &origin) < 0)
		return verdict(CAPY_STAT_DROP_TCPMIG_UNKNOWN, XDP_DROP);
	osrv = bpf_map_lookup_elem(&servers, &origin);
	if (!osrv)
		return verdict(CAPY_STAT_DROP_TCPMIG_UNKNOWN, XDP_DROP);

	flow = bpf_map_lookup_elem(&flows, &key);
	old = bpf_map_lookup_elem(&migrations, &key);
	if (old) {
		if (mig_supersedes(old, origin, id, bpf_be64_to_cpu(m->epoch))) {
			err = put_migration(&key, target, CAPY_MIG_PENDING, id, BPF_ANY);
		} else if (old->migration_id == id && old->server == target) {
			/* Duplicate (PREPARE retransmitted): no change. */
			count_only(CAPY_STAT_FWD_PREPARE_ACK);
			return send_to_server(eth, ip, udp, osrv);
		} else {
			return verdict(CAPY_STAT_DROP_PREPARE_ACK_STALE, XDP_DROP);
		}
	} else {
		/* Without an entry the owner is the flow's placement (taken,
		 * a closed connection's late PREPARE_ACK on a reused 4-tuple
		 * sent the new connection to a server without it). */
		if (flow && !placed_on_origin(flow, origin))
			return verdict(CAPY_STAT_DROP_PREPARE_ACK_STALE, XDP_DROP);
		err = put_migration(&key, target, CAPY_MIG_PENDING, id, BPF_NOEXIST);
		if (err == -17 /* EEXIST: another CPU installed one meanwhile */)
			return verdict(CAPY_STAT_DROP_PREPARE_ACK_STALE, XDP_DROP);
	}
	if (err < 0)
		return verdict(CAPY_STAT_DROP_MIGRATION_FULL, XDP_DROP);
	if (flow)
		flow->flags |= CAPY_FLOW_MIGRATED;
	count_only(CAPY_STAT_FWD_PREPARE_ACK);
	return send_to_server(eth, ip, udp, osrv);
}

/* CONN_STATE_ACK(M, o, t): t imported the connection and owns it. A matching
 * pending entry becomes final; the owner change is reported to the store
 * (it persists final owners only).
 *
 * Without M's pending entry, the ACK still settles the flow on t where M's
 * PREPARE_ACK would have been taken here (no entry and o is the placement,
 * or mig_supersedes()): that PREPARE_ACK passed another program. During a
 * takeover in place the predecessor's program and this one both run until
 * the last link is replaced, so a migration's PREPARE_ACK can pass the
 * predecessor (pending there) and its CONN_STATE_ACK this program, which
 * ignored it: the copy's final entry stayed, the predecessor's pending one
 * was applied at the end of the adoption, and the flow's entry stayed
 * pending for good (every later PREPARE_ACK of it dropped as stale).
 * mig_supersedes() keeps a CONN_STATE_ACK delayed past later migrations of
 * the flow from taking it back. An ACK that settles nothing here is
 * remembered (note_unmatched_outcome) for the end of a takeover. */
static __always_inline void on_conn_state_ack(struct tcpmig_hdr *m, __be32 saddr)
{
	struct capy_flow_key key = mig_flow_key(m);
	__u32 target, origin;
	__u64 id = mig_id(m);
	struct capy_migration *e;
	struct capy_flow *flow;
	int have_origin;

	if (lookup_server_idx(m->target ? m->target : saddr, &target) < 0)
		return;
	have_origin = lookup_server_idx(m->origin, &origin) == 0;
	flow = bpf_map_lookup_elem(&flows, &key);
	e = bpf_map_lookup_elem(&migrations, &key);
	if (e && e->pending && e->migration_id == id && e->server == target) {
		if (put_migration(&key, target, CAPY_MIG_FINAL, id, BPF_EXIST) < 0)
			return;
	} else if (!have_origin || target == origin) {
		return;
	} else if (e) {
		if (!mig_supersedes(e, origin, id, bpf_be64_to_cpu(m->epoch))) {
			note_unmatched_outcome(e, id, target);
			return;
		}
		if (put_migration(&key, target, CAPY_MIG_FINAL, id, BPF_EXIST) < 0)
			return;
	} else {
		/* No entry: the owner is the placement, which must be the
		 * origin, as for PREPARE_ACK; a closed flow (no flow entry)
		 * stays closed. */
		if (!flow || !placed_on_origin(flow, origin)) {
			if (flow)
				note_unmatched_outcome(NULL, id, target);
			return;
		}
		if (put_migration(&key, target, CAPY_MIG_FINAL, id, BPF_NOEXIST) < 0)
			return;
		flow->flags |= CAPY_FLOW_MIGRATED;
	}
	if (!have_origin)
		origin = target;
	emit_event(&key, flow && flow->server == target ? CAPY_EV_RETURNED : CAPY_EV_MIGRATED,
		   target, origin);
}

/* ABORT decision (IP destination == its origin field: the target promises
 * never to commit M): a pending entry of M toward the target becomes final
 * on the origin; without an entry, a final one on the origin is installed
 * as a tombstone (a PREPARE_ACK of M delayed in the network must not
 * redirect the flow later). A final entry that M's PREPARE_ACK could have
 * taken over (it never passed) moves on to M for the same reason. */
static __always_inline void on_abort_decision(struct tcpmig_hdr *m)
{
	struct capy_flow_key key = mig_flow_key(m);
	__u32 target, origin;
	__u64 id = mig_id(m);
	struct capy_migration *e;
	struct capy_flow *flow;

	if (lookup_server_idx(m->origin, &origin) < 0)
		return;
	e = bpf_map_lookup_elem(&migrations, &key);
	if (e) {
		if (e->pending && e->migration_id == id && lookup_server_idx(m->target, &target) == 0 &&
		    e->server == target)
			put_migration(&key, origin, CAPY_MIG_FINAL, id, BPF_EXIST);
		else if (mig_supersedes(e, origin, id, bpf_be64_to_cpu(m->epoch)))
			put_migration(&key, origin, CAPY_MIG_FINAL, id, BPF_EXIST);
		else
			note_unmatched_outcome(e, id, origin);
		return;
	}
	/* No entry: the owner is the placement; a tombstone elsewhere would
	 * redirect the flow. */
	flow = bpf_map_lookup_elem(&flows, &key);
	if (flow && flow->server != origin) {
		note_unmatched_outcome(NULL, id, origin);
		return;
	}
	put_migration(&key, origin, CAPY_MIG_FINAL, id, BPF_NOEXIST);
}

/* ABORT request addressed to the switch (the origin does not know the
 * target): steered to the target of a pending entry of the same migration,
 * otherwise dropped (no migration of that id is in flight). */
static __always_inline int handle_abort_to_switch(struct ethhdr *eth, struct iphdr *ip, struct udphdr *udp,
						  struct tcpmig_hdr *m)
{
	struct capy_flow_key key = mig_flow_key(m);
	struct capy_migration *e = bpf_map_lookup_elem(&migrations, &key);
	struct capy_server *srv;
	__u32 idx;

	if (!e || !e->pending || e->migration_id != mig_id(m))
		return verdict(CAPY_STAT_DROP_ABORT_UNMATCHED, XDP_DROP);
	idx = e->server;
	srv = bpf_map_lookup_elem(&servers, &idx);
	if (!srv || srv->state == CAPY_SERVER_EMPTY)
		return verdict(CAPY_STAT_DROP_ABORT_UNMATCHED, XDP_DROP);
	count_only(CAPY_STAT_FWD_TCPMIG);
	return send_to_server(eth, ip, udp, srv);
}

static __always_inline int handle_tcpmig(struct xdp_md *ctx, struct ethhdr *eth, struct iphdr *ip,
					 struct udphdr *udp, __u32 udp_len)
{
	void *data_end = (void *)(long)ctx->data_end;
	struct tcpmig_hdr *m = (void *)(udp + 1);
	struct capy_server *srv;
	__u32 idx;

	if ((void *)(m + 1) > data_end || udp_len < sizeof(*udp) + TCPMIG_MIN_LEN)
		return verdict(CAPY_STAT_DROP_TCPMIG_MALFORMED, XDP_DROP);
	if (m->magic != bpf_htons(TCPMIG_MAGIC) || m->version != TCPMIG_VERSION)
		return verdict(CAPY_STAT_DROP_TCPMIG_MALFORMED, XDP_DROP);
	if (udp_len < sizeof(*udp) + TCPMIG_MIN_LEN + bpf_ntohs(m->payload_len))
		return verdict(CAPY_STAT_DROP_TCPMIG_MALFORMED, XDP_DROP);

	switch (m->kind) {
	case TCPMIG_KIND_PREPARE:
		return handle_prepare(eth, ip, udp, m);
	case TCPMIG_KIND_PREPARE_ACK:
		return handle_prepare_ack(eth, ip, udp, m);
	case TCPMIG_KIND_CONN_STATE_ACK:
		on_conn_state_ack(m, ip->saddr);
		goto direct;
	case TCPMIG_KIND_ABORT: {
		__u32 zero = 0;
		struct capy_config *cfg = bpf_map_lookup_elem(&config, &zero);

		if (ip->daddr == m->origin)
			on_abort_decision(m);
		else if (cfg && ip->daddr == cfg->switch_server_ip)
			return handle_abort_to_switch(eth, ip, udp, m);
		goto direct;
	}
	case TCPMIG_KIND_CONN_STATE:
	case TCPMIG_KIND_REJECT:
	direct:
		/* Origin <-> target directly; forward without the kernel. */
		if (lookup_server_idx(ip->daddr, &idx) < 0)
			return verdict(CAPY_STAT_PASS_NOT_SERVICE, XDP_PASS);
		srv = bpf_map_lookup_elem(&servers, &idx);
		if (!srv || srv->state == CAPY_SERVER_EMPTY)
			return verdict(CAPY_STAT_PASS_NOT_SERVICE, XDP_PASS);
		count_only(CAPY_STAT_FWD_TCPMIG);
		return forward_l2(eth, srv);
	default:
		return verdict(CAPY_STAT_DROP_TCPMIG_MALFORMED, XDP_DROP);
	}
}

/* ------------------------------------------------------------------------ */
/* Entry point                                                              */
/* ------------------------------------------------------------------------ */

/* A server's FIN (source = VIP:port, destination = the client). */
static __always_inline void note_server_fin(const struct iphdr *ip, const struct tcphdr *tcp)
{
	struct capy_flow_key key = {
		.client_ip = ip->daddr,
		.service_ip = ip->saddr,
		.client_port = tcp->dest,
		.service_port = tcp->source,
	};
	struct capy_migration *mig;
	struct capy_flow *flow = bpf_map_lookup_elem(&flows, &key);
	__u32 server;

	if (!flow)
		return;
	mig = bpf_map_lookup_elem(&migrations, &key);
	server = mig ? mig->server : flow->server;
	note_fin(&key, flow, CAPY_FLOW_FIN_SERVER, server);
}

/* A reset from the server that owns a flow (source = VIP:port, Ethernet
 * source = the owner's MAC): that server's stack has no such connection
 * (it refused the SYN, or its hostagent restarted and a recovered segment
 * reached it), so the connection is over at the client and its entry goes
 * now, as with a client's reset. Before, such entries stayed until the LRU
 * evicted them: the embryonic reaper leaves established entries alone, and
 * a drain of that server waited for them until its deadline. Flows with a
 * migration entry are left alone: a reset from another server than the
 * one serving the connection now must not end it. */
static __always_inline void note_server_rst(const struct ethhdr *eth, const struct iphdr *ip,
					    const struct tcphdr *tcp)
{
	struct capy_flow_key key = {
		.client_ip = ip->daddr,
		.service_ip = ip->saddr,
		.client_port = tcp->dest,
		.service_port = tcp->source,
	};
	struct capy_flow *flow = bpf_map_lookup_elem(&flows, &key);
	const struct capy_server *srv;
	__u32 server;

	if (!flow || bpf_map_lookup_elem(&migrations, &key))
		return;
	server = flow->server;
	srv = bpf_map_lookup_elem(&servers, &server);
	if (!srv || eth->h_source[0] != srv->mac[0] || eth->h_source[1] != srv->mac[1] ||
	    eth->h_source[2] != srv->mac[2] || eth->h_source[3] != srv->mac[3] ||
	    eth->h_source[4] != srv->mac[4] || eth->h_source[5] != srv->mac[5])
		return;
	emit_event(&key, CAPY_EV_CLOSED, server, server);
	bpf_map_delete_elem(&flows, &key);
}

/* What server_rst_from_vip's walk over the services looks for. */
struct rst_vip_search {
	struct capy_flow_key key; /* service_ip set by each candidate */
	__u32 server;             /* index of the reset's sender */
	__u32 found;
};

/* bpf_for_each_map_elem callback over `services`: stops at the TCP service
 * on the reset's port whose flow with the reset's client is the sender's. */
static long rst_vip_match(void *map, struct capy_service_key *sk, struct capy_service *svc,
			  struct rst_vip_search *s)
{
	struct capy_flow *flow;

	if (sk->proto != IPPROTO_TCP || sk->port != s->key.service_port)
		return 0;
	s->key.service_ip = sk->vip;
	flow = bpf_map_lookup_elem(&flows, &s->key);
	if (!flow || flow->server != s->server)
		return 0;
	s->found = 1;
	return 1;
}

/* A reset from a server's data address instead of the VIP: its stack
 * refused a SYN for a port it does not listen on and could not tell which
 * VIP the client used (the switch rewrote the destination to the data
 * address; its listeners are bound to 0.0.0.0 or to several VIPs). The
 * client ignores a reset from an address it did not connect to and retries
 * its SYN until connect() times out; from VIP:port it fails at once
 * ("connection refused"). The source becomes the VIP of the service on the
 * reset's port whose flow with that client is on the sender (at most
 * CAPY_MAX_SERVICES candidates). Resets only: a data address that is no
 * server's costs one lookup, other packets nothing. */
static __always_inline void server_rst_from_vip(struct iphdr *ip, struct tcphdr *tcp)
{
	struct rst_vip_search s = {
		.key = { .client_ip = ip->daddr,
			 .client_port = tcp->dest,
			 .service_port = tcp->source },
	};

	if (lookup_server_idx(ip->saddr, &s.server) < 0)
		return;
	bpf_for_each_map_elem(&services, rst_vip_match, &s, 0);
	if (!s.found)
		return;
	ip->check = csum_replace4(ip->check, ip->saddr, s.key.service_ip);
	tcp->check = csum_replace4(tcp->check, ip->saddr, s.key.service_ip);
	ip->saddr = s.key.service_ip;
}

SEC("xdp")
int capy_switch(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct capy_iface *ifc;
	struct iphdr *ip;
	__u32 ifindex, ihl_len, tot_len;
	void *l4;

	if ((void *)(eth + 1) > data_end)
		return verdict(CAPY_STAT_DROP_SHORT_ETH, XDP_DROP);
	if (eth->h_proto != bpf_htons(ETH_P_IP))
		return verdict(CAPY_STAT_PASS_NOT_IPV4, XDP_PASS);

	ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > data_end || ip->version != 4 || ip->ihl < 5)
		return verdict(CAPY_STAT_DROP_BAD_IPV4, XDP_DROP);
	ihl_len = ip->ihl * 4;
	tot_len = bpf_ntohs(ip->tot_len);
	/* tot_len may be shorter than the frame (Ethernet padding), never longer. */
	if (tot_len < ihl_len || (void *)ip + tot_len > data_end)
		return verdict(CAPY_STAT_DROP_BAD_IPV4, XDP_DROP);
	l4 = (void *)ip + ihl_len;

	ifindex = ctx->ingress_ifindex;
	ifc = bpf_map_lookup_elem(&ifaces, &ifindex);
	if (!ifc)
		return verdict(CAPY_STAT_PASS_UNKNOWN_IFACE, XDP_PASS);

	if (ip->protocol == IPPROTO_TCP) {
		struct tcphdr *tcp = l4;
		struct capy_service_key sk = { .proto = IPPROTO_TCP };
		struct capy_service *svc;

		/* Server responses (from the VIP) need no rewrite: kernel routes.
		 * Only their FIN and RST are noted (one lookup per FIN or RST,
		 * none otherwise). */
		if (ifc->role != CAPY_IFACE_CLIENT) {
			if ((void *)(tcp + 1) <= data_end && !(ip->frag_off & bpf_htons(IP_FRAG_MASK))) {
				if (tcp->fin) {
					note_server_fin(ip, tcp);
				} else if (tcp->rst) {
					server_rst_from_vip(ip, tcp);
					note_server_rst(eth, ip, tcp);
				}
			}
			return verdict(CAPY_STAT_PASS_NOT_SERVICE, XDP_PASS);
		}
		if (ip->frag_off & bpf_htons(IP_FRAG_MASK)) {
			/* Without ports a fragment cannot be matched to a flow; the
			 * kernel owns the VIP and would answer it with a reset. */
			return verdict(CAPY_STAT_DROP_IP_FRAGMENT, XDP_DROP);
		}
		if ((void *)(tcp + 1) > data_end || tcp->doff < 5 || tcp->doff * 4 > tot_len - ihl_len)
			return verdict(CAPY_STAT_DROP_SHORT_L4, XDP_DROP);
		sk.vip = ip->daddr;
		sk.port = tcp->dest;
		svc = bpf_map_lookup_elem(&services, &sk);
		if (!svc)
			return verdict(CAPY_STAT_PASS_NOT_SERVICE, XDP_PASS);
		return handle_tcp(ctx, eth, ip, tcp, svc);
	}

	if (ip->protocol == IPPROTO_UDP) {
		struct udphdr *udp = l4;
		__u32 udp_len;

		if (ip->frag_off & bpf_htons(IP_FRAG_MASK))
			return verdict(CAPY_STAT_PASS_NOT_SERVICE, XDP_PASS);
		if ((void *)(udp + 1) > data_end)
			return verdict(CAPY_STAT_DROP_SHORT_L4, XDP_DROP);
		if (udp->dest != bpf_htons(CAPYBARA_PORT_TCPMIG))
			return verdict(CAPY_STAT_PASS_NOT_SERVICE, XDP_PASS);
		/* Forged migrations would hijack connections. */
		if (ifc->role == CAPY_IFACE_CLIENT)
			return verdict(CAPY_STAT_DROP_TCPMIG_FROM_CLIENT, XDP_DROP);
		udp_len = bpf_ntohs(udp->len);
		if (udp_len < sizeof(*udp) || udp_len > tot_len - ihl_len)
			return verdict(CAPY_STAT_DROP_TCPMIG_MALFORMED, XDP_DROP);
		return handle_tcpmig(ctx, eth, ip, udp, udp_len);
	}

	return verdict(CAPY_STAT_PASS_NOT_SERVICE, XDP_PASS);
}
