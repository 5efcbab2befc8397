/* SPDX-License-Identifier: Apache-2.0 */
/*
 * count.bpf.c: exact entry counts of the flow and migration tables, O(1).
 *
 * Since Linux 6.6 every hash map (plain or LRU, preallocated or not) keeps a
 * per-CPU counter of its elements, raised on insertion and lowered on
 * deletion and LRU eviction, and the kfunc bpf_map_sum_elem_count() sums it
 * over the possible CPUs. This program calls it for both tables and writes
 * the two counts into its context: user space runs it with one
 * BPF_PROG_TEST_RUN system call (a syscall program's context is copied back
 * to the caller), instead of walking every bucket of the maps
 * (BPF_MAP_LOOKUP_BATCH: milliseconds for the default 2M-bucket flow table).
 * Not an iter/bpf_map program (which also may call the kfunc): that visits
 * every map of the system, and each count would take creating an iterator
 * fd, reading it and closing it; the verifier takes a map the program
 * itself names as the kfunc's argument (checked on 6.18), so one call.
 *
 * A separate object from switch.bpf.c, loaded after it: on a kernel without
 * the kfunc (or whose verifier does not take a map defined by the program
 * as its argument) only this object fails to load, and switchd falls back
 * to the walk (src/bpf.rs, `Counter`).
 *
 * `flows` and `migrations` below are placeholders: before loading, user
 * space makes them the data plane's maps (bpf_map__reuse_fd), which also
 * takes their type, sizes and flags from the real maps.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

/* Opaque here; a complete (empty) type, which libbpf's check of the kfunc's
 * prototype against the kernel's BTF accepts (a forward declaration it does
 * not). */
struct bpf_map {
};
extern __s64 bpf_map_sum_elem_count(const struct bpf_map *map) __ksym;

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1);
	__uint(key_size, 12);
	__uint(value_size, 16);
} flows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1);
	__uint(key_size, 12);
	__uint(value_size, 16);
} migrations SEC(".maps");

/* The context, written by the program (mirrored in src/bpf.rs). */
struct capy_table_counts {
	__s64 flows;
	__s64 migrations;
};

SEC("syscall")
int capy_count(struct capy_table_counts *ctx)
{
	ctx->flows = bpf_map_sum_elem_count((const struct bpf_map *)&flows);
	ctx->migrations = bpf_map_sum_elem_count((const struct bpf_map *)&migrations);
	return 0;
}

/* GPL-compatible: the kernel lets only such programs call kfuncs. */
char LICENSE[] SEC("license") = "Dual BSD/GPL";
