// SPDX-License-Identifier: Apache-2.0
// A do-nothing XDP program for the lab's client and server interfaces.
// A veth only accepts frames that the switch's XDP program redirects into it
// when its peer runs in NAPI mode, which needs either GRO (which would merge
// segments before the user-space stack's AF_PACKET socket sees them) or an
// XDP program. This is that program: every frame goes on to the kernel.
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

SEC("xdp")
int capy_lab_pass(struct xdp_md *ctx)
{
	return XDP_PASS;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
