/* Thin C shim over DPDK for the capybara-net `dpdk` backend.
 *
 * rte_eth_rx_burst/tx_burst and the mbuf accessors are static inline in the
 * DPDK headers, so Rust cannot call them directly; these wrappers give them
 * linkable symbols. Everything here is called once per batch or once per
 * mbuf; nothing allocates beyond the mempool created at setup. */
#include <rte_eal.h>
#include <rte_ethdev.h>
#include <rte_mbuf.h>
#include <rte_mempool.h>
#include <rte_errno.h>
#include <string.h>

int cpb_eal_init(int argc, char **argv) {
    int r = rte_eal_init(argc, argv);
    return r < 0 ? -rte_errno : r;
}

int cpb_eal_cleanup(void) { return rte_eal_cleanup(); }

const char *cpb_strerror(int err) { return rte_strerror(err); }

int cpb_port_by_name(const char *name, uint16_t *port) {
    return rte_eth_dev_get_port_by_name(name, port);
}

uint16_t cpb_port_count(void) { return rte_eth_dev_count_avail(); }

/* Configures `port` with one RX and one TX queue fed by a new mempool, starts
 * it, and reports its MAC. Returns 0 or a negative errno. */
int cpb_port_setup(uint16_t port, const char *pool_name, unsigned nb_mbufs, uint16_t nb_rxd, uint16_t nb_txd,
                   struct rte_mempool **pool_out, uint8_t mac_out[6]) {
    struct rte_eth_conf conf;
    memset(&conf, 0, sizeof conf);
    int socket = rte_eth_dev_socket_id(port);
    if (socket < 0) socket = (int)rte_socket_id();
    struct rte_mempool *pool =
        rte_pktmbuf_pool_create(pool_name, nb_mbufs, 256, 0, RTE_MBUF_DEFAULT_BUF_SIZE, socket);
    if (pool == NULL) return -rte_errno;
    int r = rte_eth_dev_configure(port, 1, 1, &conf);
    if (r < 0) return r;
    r = rte_eth_dev_adjust_nb_rx_tx_desc(port, &nb_rxd, &nb_txd);
    if (r < 0) return r;
    r = rte_eth_rx_queue_setup(port, 0, nb_rxd, socket, NULL, pool);
    if (r < 0) return r;
    r = rte_eth_tx_queue_setup(port, 0, nb_txd, socket, NULL);
    if (r < 0) return r;
    r = rte_eth_dev_start(port);
    if (r < 0) return r;
    struct rte_ether_addr mac;
    r = rte_eth_macaddr_get(port, &mac);
    if (r < 0) return r;
    memcpy(mac_out, mac.addr_bytes, 6);
    *pool_out = pool;
    return 0;
}

void cpb_port_close(uint16_t port) {
    rte_eth_dev_stop(port);
    rte_eth_dev_close(port);
}

uint16_t cpb_rx_burst(uint16_t port, struct rte_mbuf **pkts, uint16_t n) {
    return rte_eth_rx_burst(port, 0, pkts, n);
}

uint16_t cpb_tx_burst(uint16_t port, struct rte_mbuf **pkts, uint16_t n) {
    return rte_eth_tx_burst(port, 0, pkts, n);
}

/* First segment's data; multi-segment frames report only the first segment
 * (jumbo frames are not configured, so every frame is one segment). */
const uint8_t *cpb_mbuf_data(const struct rte_mbuf *m, uint16_t *len) {
    *len = m->data_len;
    return rte_pktmbuf_mtod(m, const uint8_t *);
}

int cpb_mbuf_alloc_bulk(struct rte_mempool *pool, struct rte_mbuf **m, unsigned n) {
    return rte_pktmbuf_alloc_bulk(pool, m, n);
}

/* Writable room of a fresh mbuf. */
uint8_t *cpb_mbuf_room(struct rte_mbuf *m, uint16_t *cap) {
    *cap = rte_pktmbuf_tailroom(m);
    return rte_pktmbuf_mtod(m, uint8_t *);
}

void cpb_mbuf_set_len(struct rte_mbuf *m, uint16_t len) {
    m->data_len = len;
    m->pkt_len = len;
}

void cpb_mbuf_free(struct rte_mbuf *m) { rte_pktmbuf_free(m); }

void cpb_mbuf_free_bulk(struct rte_mbuf **m, unsigned n) { rte_pktmbuf_free_bulk(m, n); }
