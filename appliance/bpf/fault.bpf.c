// SPDX-License-Identifier: Apache-2.0
// Lab fault injector: a tc (clsact) program that drops, duplicates or delays
// a configured fraction of the packets crossing one interface, because the
// lab machines have no sch_netem. Loaded by `capybara lab fault`.
//
// Delay uses earliest-departure-time (skb->tstamp), which only a fq qdisc
// honours; the loader refuses a delay where fq is missing rather than
// pretending. Reordering follows from delaying a fraction of packets.
#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

// Marks the copy made by bpf_clone_redirect so that it is not duplicated
// again when it re-enters this hook.
#define CLONE_MARK 0xca9bfa17

struct fault_cfg {
	__u32 drop_threshold;  // drop when prandom < threshold (rate * 2^32)
	__u32 dup_threshold;   // duplicate when prandom < threshold
	__u32 delay_threshold; // delay when prandom < threshold
	__u32 delay_us;        // how long
};

struct fault_stats {
	__u64 seen;
	__u64 dropped;
	__u64 duplicated;
	__u64 delayed;
};

// Index 0: the configuration written by the loader.
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct fault_cfg);
} fault_cfg SEC(".maps");

// Index 0: what the program did, read by `capybara lab fault --stats`.
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct fault_stats);
} fault_stats SEC(".maps");

SEC("tc")
int capy_fault(struct __sk_buff *skb)
{
	__u32 zero = 0;
	struct fault_cfg *cfg = bpf_map_lookup_elem(&fault_cfg, &zero);
	struct fault_stats *st = bpf_map_lookup_elem(&fault_stats, &zero);
	if (!cfg || !st)
		return TC_ACT_OK;
	if (skb->mark == CLONE_MARK) {
		skb->mark = 0;
		return TC_ACT_OK;
	}
	st->seen++;
	if (cfg->drop_threshold && bpf_get_prandom_u32() < cfg->drop_threshold) {
		st->dropped++;
		return TC_ACT_SHOT;
	}
	if (cfg->dup_threshold && bpf_get_prandom_u32() < cfg->dup_threshold) {
		__u32 old = skb->mark;
		skb->mark = CLONE_MARK;
		if (bpf_clone_redirect(skb, skb->ifindex, 0) == 0)
			st->duplicated++;
		skb->mark = old;
	}
	if (cfg->delay_us && cfg->delay_threshold &&
	    bpf_get_prandom_u32() < cfg->delay_threshold) {
		__u64 now = bpf_ktime_get_ns();
		skb->tstamp = now + (__u64)cfg->delay_us * 1000;
		st->delayed++;
	}
	return TC_ACT_OK;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
