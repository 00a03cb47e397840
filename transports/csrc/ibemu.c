/*
 * weftcc's emulated RDMA device: a user-space stand-in for libibverbs.so.1, for tests on
 * machines without RDMA hardware. It exports the verbs entry points weft's shim
 * (csrc/ibv_shim.c) looks up, and fills the operation table of `struct ibv_context` (laid out
 * by the system's <infiniband/verbs.h>) so that the header's inline ibv_post_send,
 * ibv_post_recv and ibv_poll_cq reach it.
 *
 * It is loaded only through an explicit path (WEFT_IB_LIBRARY): nothing installs it where the
 * loader finds libibverbs.
 *
 * The device: one port ("weftemu0", port 1, RoCE, GID index 0). The wire: every process that
 * opens the device runs an emulated NIC, a thread listening on a SOCK_SEQPACKET Unix socket
 * whose *file-system* name is its GID in hex under WEFT_IBEMU_DIR (default
 * /tmp/weft-ibemu-<uid>): path names, unlike abstract ones, are reachable across network
 * namespaces, so ranks in different namespaces ("hosts") reach each other. Packets carry
 * at most 64 KiB; the receiving NIC checks them the way a responder does and places them into
 * registered memory:
 *   - a packet for a QP that is not in RTR or RTS, or from another source than the QP's
 *     remote, is dropped without an answer; the requester resends everything unacknowledged
 *     after the ACK timeout (4.096 us x 2^timeout) and, after retry_cnt resends, completes the
 *     work request with IBV_WC_RETRY_EXC_ERR and moves its QP to ERR (flushing the rest);
 *   - an rkey that names no region of the QP's protection domain, a region without
 *     REMOTE_WRITE, a QP without REMOTE_WRITE access, or bytes outside the region: the
 *     responder QP goes to ERR and the requester gets IBV_WC_REM_ACCESS_ERR (QP to ERR);
 *   - SEND and RDMA_WRITE_WITH_IMM consume a posted receive (none: receiver-not-ready, resent
 *     after 1 ms, forever at rnr_retry 7); a SEND longer than the receive: IBV_WC_REM_INV_REQ_ERR;
 *   - acknowledgements are cumulative and sent only for placed bytes, so a completed write is
 *     a placed write; receive completions come only once every earlier write of the QP is
 *     placed (what write-with-immediate promises).
 * Posting checks what a device checks: the QP's state (EINVAL before RTS; flushed in ERR), a
 * full send queue (ENOMEM), inline data above the QP's max_inline_data (EINVAL), local keys
 * and bounds (IBV_WC_LOC_PROT_ERR). A completion queue that overflows reports an error from
 * every later poll.
 *
 * Fault knobs (environment, read when the device is opened; see docs/network.md):
 *   WEFT_IBEMU_DIR               directory of the NICs' sockets
 *   WEFT_IBEMU_DELAY_WRITES_US   relaxed placement: RDMA-write packets of more than 64 bytes
 *                                are placed this long after they arrive, later (smaller)
 *                                writes of the same QP are not held back
 *   WEFT_IBEMU_RTR_DELAY_MS      of the two QPs of a connection, the one with the larger
 *                                number takes this long to reach RTR (the set-up race)
 *   WEFT_IBEMU_QP_ERR_AFTER      every QP of this process goes to ERR at its n-th post
 *   WEFT_IBEMU_VANISH_AFTER      this process exits (status 41) when it posts a small write
 *                                (a flag) after its n-th write of more than 64 bytes
 *   WEFT_IBEMU_CQE_DELAY_US      completions become visible this long after they happen
 *   WEFT_IBEMU_MAX_INLINE        the largest inline payload (default 64)
 *   WEFT_IBEMU_REFUSE_DMABUF     1: ibv_reg_dmabuf_mr fails with EOPNOTSUPP (a NIC or kernel
 *                                without dmabuf support)
 *   WEFT_IBEMU_REM_ACCESS_AFTER  the n-th RDMA-write packet of more than 64 bytes this process
 *                                receives is refused as a remote access error (the responder
 *                                QP goes to ERR, the requester gets IBV_WC_REM_ACCESS_ERR)
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <infiniband/verbs.h>

#define EXPORT(name) __asm__(name) __attribute__((visibility("default")))
#define PKT_MAX (64 * 1024)
#define SMALL 64
#define MAGIC 0x57454d55u /* "WEMU" */
#define MAX_SGE 4
#define MAX_INLINE_DEFAULT 64
#define RNR_DELAY_NS 1000000ull

/* Appends `item` to the singly linked queue `head`..`tail`. */
#define QUEUE_PUSH(head, tail, item)                                                              \
    do {                                                                                          \
        (item)->next = NULL;                                                                      \
        if (tail)                                                                                 \
            (tail)->next = (item);                                                                \
        else                                                                                      \
            (head) = (item);                                                                      \
        (tail) = (item);                                                                          \
    } while (0)

/* Removes `item` from the singly linked list `head` of `type`s, if it is there. */
#define LIST_UNLINK(type, head, item)                                                             \
    do {                                                                                          \
        for (type **pp_ = &(head); *pp_; pp_ = &(*pp_)->next)                                    \
            if (*pp_ == (item)) {                                                                 \
                *pp_ = (item)->next;                                                              \
                break;                                                                            \
            }                                                                                     \
    } while (0)

enum { P_DATA = 1, P_ACK = 2, P_NAK = 3 };
enum { NAK_ACCESS = 1, NAK_RNR = 2, NAK_INV = 3 };
enum { OP_WRITE = 1, OP_WRITE_IMM = 2, OP_SEND = 3 };

struct hdr {
    uint32_t magic;
    uint8_t type, op, last, syndrome;
    uint8_t src_gid[16];
    uint32_t src_qpn, dst_qpn;
    uint32_t psn, len;
    uint64_t raddr;
    uint32_t rkey, imm;
    uint32_t total, offset;
};

/* ---- the state of this process's device, under one lock ---- */

struct msg {
    struct msg *next;
    size_t len;
    unsigned char data[];
};

struct conn {
    struct conn *next;
    uint8_t gid[16];
    int fd;
    struct msg *head, *tail;
};

struct inbound {
    struct inbound *next;
    int fd;
};

struct emu_mr {
    struct ibv_mr mr;
    struct emu_mr *next;
    unsigned char *host; /* where offset 0 of the region is in this process */
    uint64_t iova;       /* the address requests name offset 0 by */
    int access;
    void *map;           /* a dmabuf mapping to unmap, if any */
    size_t map_len;
};

struct cqe {
    struct ibv_wc wc;
    uint64_t due;
};

struct emu_cq {
    struct ibv_cq cq;
    struct cqe *ring;
    int cap, head, count, overflow;
};

struct swqe {
    struct swqe *next;
    uint64_t wr_id;
    uint32_t last_psn;
    uint32_t byte_len;
    int op, signaled;
};

struct pkt {
    struct pkt *next;
    struct swqe *wqe;
    uint32_t psn;
    size_t len; /* header + payload */
    unsigned char data[];
};

struct rwqe {
    uint64_t wr_id;
    struct ibv_sge sge[MAX_SGE];
    int nsge;
};

struct held {
    struct held *next;
    uint32_t psn;
    uint64_t due;
    unsigned char *dst;
    size_t len;
    unsigned char data[];
};

struct pending_recv {
    struct pending_recv *next;
    uint32_t psn;
    struct ibv_wc wc;
};

struct emu_qp {
    struct ibv_qp qp;
    struct emu_qp *next;
    int access;
    uint32_t max_send_wr, max_recv_wr, max_inline;
    /* remote */
    uint8_t dgid[16];
    uint32_t dqpn;
    uint32_t epsn;     /* next inbound psn expected */
    uint32_t placed;   /* every inbound psn before this one is placed */
    uint32_t acked_to; /* the last placed value acknowledged */
    int ack_due;
    uint32_t npsn;     /* next outbound psn */
    uint8_t timeout, retry_cnt, rnr_retry;
    int retries_left, rnr_left;
    int rnr_wait;      /* the deadline is a receiver-not-ready pause, not an ACK timeout */
    uint64_t deadline; /* resend time of the unacknowledged packets, 0: none */
    struct swqe *sq, *sq_tail;
    uint32_t sq_count;
    /* Send work requests whose completion was not polled yet: a device reuses a send queue
     * slot only then, so this is what fills the queue. */
    uint32_t sq_unpolled;
    struct pkt *un, *un_tail;
    struct rwqe *rq;
    uint32_t rq_head, rq_count;
    struct rwqe cur_recv;
    int cur_recv_active;
    struct held *held, *held_tail;
    struct pending_recv *precv, *precv_tail;
    uint64_t posts;
};

struct emu_ctx {
    struct ibv_context ctx;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_refs;
static pthread_t g_thread;
static int g_stop;
static int g_wake[2] = {-1, -1};
static int g_listen = -1;
static char g_dir[72]; /* leaves room for "/" and 32 hex digits in a socket name */
static char g_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
static uint8_t g_gid[16];
static struct emu_qp *g_qps;
static struct emu_mr *g_mrs;
static struct conn *g_conns;
static struct inbound *g_in;
static struct ibv_device g_device;
/* knobs */
static uint64_t k_delay_writes_ns, k_rtr_delay_ms, k_qp_err_after, k_vanish_after, k_cqe_delay_ns;
static uint64_t k_refuse_dmabuf, k_rem_access_after, g_big_received;
static uint32_t k_max_inline = MAX_INLINE_DEFAULT;
static uint64_t g_big_writes;

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static uint64_t knob(const char *name, uint64_t dflt) {
    const char *v = getenv(name);
    if (!v || !*v)
        return dflt;
    char *end;
    unsigned long long x = strtoull(v, &end, 10);
    if (*end) {
        fprintf(stderr, "weft ibemu: %s=%s is not a whole number; ignored\n", name, v);
        return dflt;
    }
    return x;
}

static uint32_t random32(void) {
    uint32_t r = 0;
    if (syscall(SYS_getrandom, &r, sizeof r, 0) != sizeof r)
        r = (uint32_t)now_ns() ^ (uint32_t)getpid();
    return r;
}

static int psn_before(uint32_t a, uint32_t b) { /* a < b in 24-bit sequence space */
    uint32_t d = (b - a) & 0xffffff;
    return d != 0 && d < 0x800000;
}

static void wake(void) {
    char c = 1;
    if (g_wake[1] >= 0 && write(g_wake[1], &c, 1) < 0) {
        /* the pipe is full: the thread is awake anyway */
    }
}

static struct emu_qp *find_qp(uint32_t qpn);

/* ---- completion queues ---- */

static void cq_push(struct ibv_cq *cq, const struct ibv_wc *wc) {
    struct emu_cq *c = (struct emu_cq *)cq;
    if (c->count == c->cap) {
        c->overflow = 1;
        return;
    }
    struct cqe *e = &c->ring[(c->head + c->count) % c->cap];
    e->wc = *wc;
    e->due = k_cqe_delay_ns ? now_ns() + k_cqe_delay_ns : 0;
    c->count++;
}

static int emu_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc) {
    struct emu_cq *c = (struct emu_cq *)cq;
    pthread_mutex_lock(&g_lock);
    if (c->overflow) {
        pthread_mutex_unlock(&g_lock);
        return -EOVERFLOW;
    }
    uint64_t now = k_cqe_delay_ns ? now_ns() : 0;
    int got = 0;
    while (got < n && c->count > 0 && c->ring[c->head].due <= now) {
        struct ibv_wc *w = &wc[got++];
        *w = c->ring[c->head].wc;
        c->head = (c->head + 1) % c->cap;
        c->count--;
        if (w->opcode == IBV_WC_SEND || w->opcode == IBV_WC_RDMA_WRITE) {
            struct emu_qp *q = find_qp(w->qp_num);
            if (q && q->sq_unpolled)
                q->sq_unpolled--;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return got;
}

/* ---- queue pairs: errors and completions ---- */

static void complete_send(struct emu_qp *q, struct swqe *w, enum ibv_wc_status st) {
    if (!w->signaled && st == IBV_WC_SUCCESS) {
        q->sq_unpolled--;
        return;
    }
    struct ibv_wc wc;
    memset(&wc, 0, sizeof wc);
    wc.wr_id = w->wr_id;
    wc.status = st;
    wc.opcode = w->op == OP_SEND ? IBV_WC_SEND : IBV_WC_RDMA_WRITE;
    wc.byte_len = w->byte_len;
    wc.qp_num = q->qp.qp_num;
    cq_push(q->qp.send_cq, &wc);
}

/* Frees the singly linked list at `head` (linked through `next`), leaving `head` NULL. */
#define FREE_LIST(head)                           \
    do {                                          \
        while (head) {                            \
            __typeof__(head) next_ = (head)->next; \
            free(head);                           \
            (head) = next_;                       \
        }                                         \
    } while (0)

static void free_packets(struct emu_qp *q) {
    FREE_LIST(q->un);
    q->un_tail = NULL;
    q->deadline = 0;
}

static void free_held(struct emu_qp *q) {
    FREE_LIST(q->held);
    q->held_tail = NULL;
    FREE_LIST(q->precv);
    q->precv_tail = NULL;
}

/* Moves the QP to ERR: the first send work request gets `first` (unless success), every other
 * outstanding one and every posted receive is flushed. */
static void qp_error(struct emu_qp *q, enum ibv_wc_status first) {
    q->qp.state = IBV_QPS_ERR;
    free_packets(q);
    free_held(q);
    int n = 0;
    while (q->sq) {
        struct swqe *w = q->sq;
        q->sq = w->next;
        w->signaled = 1;
        complete_send(q, w, n++ == 0 && first != IBV_WC_SUCCESS ? first : IBV_WC_WR_FLUSH_ERR);
        free(w);
    }
    q->sq_tail = NULL;
    q->sq_count = 0;
    if (q->cur_recv_active) {
        q->cur_recv_active = 0;
        struct ibv_wc wc = {.wr_id = q->cur_recv.wr_id, .status = IBV_WC_WR_FLUSH_ERR,
                            .opcode = IBV_WC_RECV, .qp_num = q->qp.qp_num};
        cq_push(q->qp.recv_cq, &wc);
    }
    while (q->rq_count) {
        struct ibv_wc wc = {.wr_id = q->rq[q->rq_head].wr_id, .status = IBV_WC_WR_FLUSH_ERR,
                            .opcode = IBV_WC_RECV, .qp_num = q->qp.qp_num};
        cq_push(q->qp.recv_cq, &wc);
        q->rq_head = (q->rq_head + 1) % q->max_recv_wr;
        q->rq_count--;
    }
}

static struct emu_qp *find_qp(uint32_t qpn) {
    for (struct emu_qp *q = g_qps; q; q = q->next)
        if (q->qp.qp_num == qpn)
            return q;
    return NULL;
}

static struct emu_mr *find_mr(uint32_t key) {
    for (struct emu_mr *m = g_mrs; m; m = m->next)
        if (m->mr.rkey == key)
            return m;
    return NULL;
}

/* `len` bytes at request address `va` of region `m`, or NULL when outside it. */
static unsigned char *mr_at(struct emu_mr *m, uint64_t va, size_t len) {
    if (va < m->iova || len > m->mr.length || va - m->iova > m->mr.length - len)
        return NULL;
    return m->host + (va - m->iova);
}

/* ---- the wire ---- */

static void set_nonblock(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

static void gid_path(const uint8_t gid[16], char *out, size_t len) {
    char hex[33];
    for (int i = 0; i < 16; i++)
        snprintf(hex + 2 * i, 3, "%02x", gid[i]);
    snprintf(out, len, "%s/%s", g_dir, hex);
}

static void conn_flush(struct conn *c) {
    while (c->head && c->fd >= 0) {
        ssize_t n = send(c->fd, c->head->data, c->head->len, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS)
                return;
            /* The peer's NIC is gone: what was queued is lost (the requester's timers see it). */
            close(c->fd);
            c->fd = -1;
            break;
        }
        struct msg *m = c->head;
        c->head = m->next;
        free(m);
    }
    if (c->fd < 0) {
        while (c->head) {
            struct msg *m = c->head;
            c->head = m->next;
            free(m);
        }
    }
    if (!c->head)
        c->tail = NULL;
}

static struct conn *conn_to(const uint8_t gid[16]) {
    struct conn *c;
    for (c = g_conns; c; c = c->next)
        if (memcmp(c->gid, gid, 16) == 0)
            break;
    if (!c) {
        c = calloc(1, sizeof *c);
        if (!c)
            return NULL;
        memcpy(c->gid, gid, 16);
        c->fd = -1;
        c->next = g_conns;
        g_conns = c;
    }
    if (c->fd < 0) {
        struct sockaddr_un a = {.sun_family = AF_UNIX};
        gid_path(gid, a.sun_path, sizeof a.sun_path);
        int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        if (fd >= 0) {
            int sz = 4 << 20;
            setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
            if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0) {
                set_nonblock(fd);
                c->fd = fd;
            } else {
                close(fd);
            }
        }
    }
    return c;
}

/* Queues a copy of a packet towards `gid` (lost if the peer cannot be reached). */
static void xmit(const uint8_t gid[16], const void *data, size_t len) {
    struct conn *c = conn_to(gid);
    if (!c || c->fd < 0)
        return;
    struct msg *m = malloc(sizeof *m + len);
    if (!m)
        return;
    m->next = NULL;
    m->len = len;
    memcpy(m->data, data, len);
    if (c->tail)
        c->tail->next = m;
    else
        c->head = m;
    c->tail = m;
    conn_flush(c);
    if (c->head)
        wake();
}

static void send_ctl(struct emu_qp *q, int type, int syndrome, uint32_t psn) {
    struct hdr h;
    memset(&h, 0, sizeof h);
    h.magic = MAGIC;
    h.type = (uint8_t)type;
    h.syndrome = (uint8_t)syndrome;
    memcpy(h.src_gid, g_gid, 16);
    h.src_qpn = q->qp.qp_num;
    h.dst_qpn = q->dqpn;
    h.psn = psn;
    xmit(q->dgid, &h, sizeof h);
}

static uint64_t ack_timeout_ns(struct emu_qp *q) {
    /* 4.096 us x 2^timeout; 0 means infinite in the specification: a day here. */
    if (q->timeout == 0)
        return 86400ull * 1000000000ull;
    return 4096ull << q->timeout;
}

static void resend_all(struct emu_qp *q) {
    for (struct pkt *p = q->un; p; p = p->next)
        xmit(q->dgid, p->data, p->len);
    q->deadline = q->un ? now_ns() + ack_timeout_ns(q) : 0;
}

/* ---- the responder ---- */

static void place_done(struct emu_qp *q) {
    /* Every psn before the first held packet (or before epsn) is placed. */
    q->placed = q->held ? q->held->psn : q->epsn;
    while (q->precv && psn_before(q->precv->psn, q->placed)) {
        struct pending_recv *r = q->precv;
        q->precv = r->next;
        if (!q->precv)
            q->precv_tail = NULL;
        cq_push(q->qp.recv_cq, &r->wc);
        free(r);
    }
    if (q->placed != q->acked_to)
        q->ack_due = 1;
}

static void flush_acks(void) {
    for (struct emu_qp *q = g_qps; q; q = q->next) {
        if (q->ack_due && (q->qp.state == IBV_QPS_RTR || q->qp.state == IBV_QPS_RTS)) {
            q->acked_to = q->placed;
            send_ctl(q, P_ACK, 0, (q->placed - 1) & 0xffffff);
        }
        q->ack_due = 0;
    }
}

static int take_recv(struct emu_qp *q) {
    if (q->cur_recv_active)
        return 1;
    if (!q->rq_count)
        return 0;
    q->cur_recv = q->rq[q->rq_head];
    q->rq_head = (q->rq_head + 1) % q->max_recv_wr;
    q->rq_count--;
    q->cur_recv_active = 1;
    return 1;
}

static void responder_error(struct emu_qp *q, int syndrome, uint32_t psn) {
    send_ctl(q, P_NAK, syndrome, psn);
    qp_error(q, IBV_WC_SUCCESS);
}

static void on_data(struct emu_qp *q, const struct hdr *h, const unsigned char *payload) {
    if (psn_before(h->psn, q->epsn)) { /* a duplicate: answer with what is placed */
        q->ack_due = 1;
        return;
    }
    if (h->psn != q->epsn)
        return; /* out of sequence: the requester resends */
    if (h->op == OP_WRITE || h->op == OP_WRITE_IMM) {
        if (h->len) {
            struct emu_mr *m = find_mr(h->rkey);
            unsigned char *dst = m ? mr_at(m, h->raddr, h->len) : NULL;
            int refused = k_rem_access_after && h->len > SMALL &&
                          ++g_big_received == k_rem_access_after;
            if (refused || !m || m->mr.pd != q->qp.pd ||
                !(m->access & IBV_ACCESS_REMOTE_WRITE) ||
                !(q->access & IBV_ACCESS_REMOTE_WRITE) || !dst) {
                responder_error(q, NAK_ACCESS, h->psn);
                return;
            }
            if (h->op == OP_WRITE_IMM && h->last && !take_recv(q)) {
                send_ctl(q, P_NAK, NAK_RNR, h->psn);
                return;
            }
            if (k_delay_writes_ns && h->len > SMALL) {
                struct held *x = malloc(sizeof *x + h->len);
                if (!x) {
                    responder_error(q, NAK_INV, h->psn);
                    return;
                }
                x->psn = h->psn;
                x->due = now_ns() + k_delay_writes_ns;
                x->dst = dst;
                x->len = h->len;
                memcpy(x->data, payload, h->len);
                QUEUE_PUSH(q->held, q->held_tail, x);
            } else {
                memcpy(dst, payload, h->len);
            }
        } else if (h->op == OP_WRITE_IMM && h->last && !take_recv(q)) {
            send_ctl(q, P_NAK, NAK_RNR, h->psn);
            return;
        }
    } else if (h->op == OP_SEND) {
        if (!take_recv(q)) {
            send_ctl(q, P_NAK, NAK_RNR, h->psn);
            return;
        }
        /* Scatter the payload at its offset into the receive's buffers. */
        size_t at = h->offset, left = h->len;
        const unsigned char *src = payload;
        for (int i = 0; i < q->cur_recv.nsge && left; i++) {
            struct ibv_sge *s = &q->cur_recv.sge[i];
            if (at >= s->length) {
                at -= s->length;
                continue;
            }
            size_t n = s->length - at < left ? s->length - at : left;
            struct emu_mr *m = find_mr(s->lkey);
            unsigned char *dst = m ? mr_at(m, s->addr + at, n) : NULL;
            if (!dst) {
                responder_error(q, NAK_INV, h->psn);
                return;
            }
            memcpy(dst, src, n);
            src += n;
            left -= n;
            at = 0;
        }
        if (left) {
            responder_error(q, NAK_INV, h->psn);
            return;
        }
    } else {
        responder_error(q, NAK_INV, h->psn);
        return;
    }
    if (h->last && (h->op == OP_SEND || h->op == OP_WRITE_IMM)) {
        struct pending_recv *r = calloc(1, sizeof *r);
        if (r) {
            r->psn = h->psn;
            r->wc.wr_id = q->cur_recv.wr_id;
            r->wc.status = IBV_WC_SUCCESS;
            r->wc.opcode = h->op == OP_SEND ? IBV_WC_RECV : IBV_WC_RECV_RDMA_WITH_IMM;
            r->wc.byte_len = h->op == OP_SEND ? h->total : 0;
            r->wc.imm_data = h->imm;
            r->wc.wc_flags = h->op == OP_WRITE_IMM ? IBV_WC_WITH_IMM : 0;
            r->wc.qp_num = q->qp.qp_num;
            r->wc.src_qp = q->dqpn;
            QUEUE_PUSH(q->precv, q->precv_tail, r);
        }
        q->cur_recv_active = 0;
    }
    q->epsn = (q->epsn + 1) & 0xffffff;
    place_done(q);
}

/* ---- the requester ---- */

static void on_ack(struct emu_qp *q, uint32_t psn, int nak, int syndrome) {
    /* Everything up to and including `psn` (before it, for a NAK) is acknowledged. */
    uint32_t upto = nak ? psn : (psn + 1) & 0xffffff;
    int progress = 0;
    while (q->un && psn_before(q->un->psn, upto)) {
        struct pkt *p = q->un;
        q->un = p->next;
        free(p);
        progress = 1;
    }
    if (!q->un)
        q->un_tail = NULL;
    while (q->sq && psn_before(q->sq->last_psn, upto)) {
        struct swqe *w = q->sq;
        q->sq = w->next;
        if (!q->sq)
            q->sq_tail = NULL;
        q->sq_count--;
        complete_send(q, w, IBV_WC_SUCCESS);
        free(w);
    }
    if (progress) {
        q->retries_left = q->retry_cnt;
        q->rnr_left = q->rnr_retry;
    }
    q->rnr_wait = 0;
    if (nak && syndrome == NAK_ACCESS) {
        qp_error(q, IBV_WC_REM_ACCESS_ERR);
        return;
    }
    if (nak && syndrome == NAK_INV) {
        qp_error(q, IBV_WC_REM_INV_REQ_ERR);
        return;
    }
    if (nak && syndrome == NAK_RNR) {
        if (q->rnr_retry != 7 && q->rnr_left-- <= 0) {
            qp_error(q, IBV_WC_RNR_RETRY_EXC_ERR);
            return;
        }
        q->rnr_wait = q->un != NULL;
        q->deadline = q->un ? now_ns() + RNR_DELAY_NS : 0;
        return;
    }
    q->deadline = q->un ? now_ns() + ack_timeout_ns(q) : 0;
}

static void on_packet(const unsigned char *buf, size_t n) {
    if (n < sizeof(struct hdr))
        return;
    struct hdr h;
    memcpy(&h, buf, sizeof h);
    if (h.magic != MAGIC || n != sizeof h + (h.type == P_DATA ? h.len : 0))
        return;
    struct emu_qp *q = find_qp(h.dst_qpn);
    /* A QP that is not ready to receive, or a packet from another QP than its remote: dropped
     * without an answer, as a device does. */
    if (!q || (q->qp.state != IBV_QPS_RTR && q->qp.state != IBV_QPS_RTS) ||
        q->dqpn != h.src_qpn || memcmp(q->dgid, h.src_gid, 16) != 0)
        return;
    if (h.type == P_DATA)
        on_data(q, &h, buf + sizeof h);
    else if (h.type == P_ACK && q->qp.state == IBV_QPS_RTS)
        on_ack(q, h.psn, 0, 0);
    else if (h.type == P_NAK && q->qp.state == IBV_QPS_RTS)
        on_ack(q, h.psn, 1, h.syndrome);
}

/* Held placements that are due, resends that are due; returns the next time to look. */
static uint64_t timers(void) {
    uint64_t now = now_ns(), next = now + 50000000ull;
    for (struct emu_qp *q = g_qps; q; q = q->next) {
        int placed = 0;
        while (q->held && q->held->due <= now) {
            struct held *x = q->held;
            q->held = x->next;
            if (!q->held)
                q->held_tail = NULL;
            memcpy(x->dst, x->data, x->len);
            free(x);
            placed = 1;
        }
        if (placed)
            place_done(q);
        if (q->held && q->held->due < next)
            next = q->held->due;
        if (q->deadline && q->qp.state == IBV_QPS_RTS) {
            if (q->deadline <= now) {
                if (q->rnr_wait)
                    q->rnr_wait = 0; /* the pause is over: resend, no retry spent */
                else if (q->retries_left-- <= 0) {
                    qp_error(q, IBV_WC_RETRY_EXC_ERR);
                    continue;
                }
                resend_all(q);
            }
            if (q->deadline && q->deadline < next)
                next = q->deadline;
        }
    }
    flush_acks();
    return next;
}

static void *nic_main(void *arg) {
    (void)arg;
    unsigned char *buf = malloc(sizeof(struct hdr) + PKT_MAX);
    struct pollfd *fds = NULL;
    size_t cap = 0;
    pthread_mutex_lock(&g_lock);
    while (!g_stop && buf) {
        uint64_t next = timers();
        size_t n = 2;
        for (struct inbound *i = g_in; i; i = i->next)
            n++;
        for (struct conn *c = g_conns; c; c = c->next)
            n++;
        if (n > cap) {
            struct pollfd *f = realloc(fds, n * sizeof *fds);
            if (!f)
                break;
            fds = f;
            cap = n;
        }
        size_t k = 0;
        fds[k++] = (struct pollfd){.fd = g_wake[0], .events = POLLIN};
        fds[k++] = (struct pollfd){.fd = g_listen, .events = POLLIN};
        for (struct inbound *i = g_in; i; i = i->next)
            fds[k++] = (struct pollfd){.fd = i->fd, .events = POLLIN};
        for (struct conn *c = g_conns; c; c = c->next)
            fds[k++] = (struct pollfd){.fd = c->head ? c->fd : -1, .events = POLLOUT};
        uint64_t now = now_ns();
        int ms = next > now ? (int)((next - now + 999999) / 1000000) : 0;
        if (ms > 50)
            ms = 50;
        pthread_mutex_unlock(&g_lock);
        int r = poll(fds, k, ms);
        pthread_mutex_lock(&g_lock);
        if (r <= 0)
            continue;
        if (fds[0].revents) {
            char drain[64];
            while (read(g_wake[0], drain, sizeof drain) > 0) {
            }
        }
        if (fds[1].revents & POLLIN) {
            int fd;
            while ((fd = accept4(g_listen, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC)) >= 0) {
                struct inbound *i = calloc(1, sizeof *i);
                if (!i) {
                    close(fd);
                    continue;
                }
                i->fd = fd;
                i->next = g_in;
                g_in = i;
            }
        }
        /* Read every inbound connection that polled readable (found by its descriptor:
         * connections accepted just now were not polled and wait for the next round). */
        struct inbound **pp = &g_in;
        for (struct inbound *i = g_in; i; i = *pp) {
            short ready = 0;
            for (size_t j = 2; j < k; j++)
                if (fds[j].fd == i->fd) {
                    ready = fds[j].revents;
                    break;
                }
            int gone = 0;
            if (ready) {
                for (int m = 0; m < 64; m++) {
                    ssize_t got = recv(i->fd, buf, sizeof(struct hdr) + PKT_MAX, MSG_DONTWAIT);
                    if (got > 0) {
                        on_packet(buf, (size_t)got);
                        continue;
                    }
                    if (got == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
                        gone = 1;
                    break;
                }
            }
            if (gone) {
                close(i->fd);
                *pp = i->next;
                free(i);
            } else {
                pp = &i->next;
            }
        }
        for (struct conn *c = g_conns; c; c = c->next)
            conn_flush(c);
        flush_acks();
    }
    pthread_mutex_unlock(&g_lock);
    free(fds);
    free(buf);
    return NULL;
}

/* Removes socket files in the fabric directory that nobody listens on (processes killed). */
static void sweep_stale(void) {
    DIR *d = opendir(g_dir);
    if (!d)
        return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strlen(e->d_name) != 32)
            continue;
        struct sockaddr_un a = {.sun_family = AF_UNIX};
        if ((size_t)snprintf(a.sun_path, sizeof a.sun_path, "%s/%s", g_dir, e->d_name) >=
            sizeof a.sun_path)
            continue;
        int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        if (fd < 0)
            continue;
        if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0 && errno == ECONNREFUSED)
            unlink(a.sun_path);
        close(fd);
    }
    closedir(d);
}

static int nic_start(void) {
    k_delay_writes_ns = knob("WEFT_IBEMU_DELAY_WRITES_US", 0) * 1000;
    k_rtr_delay_ms = knob("WEFT_IBEMU_RTR_DELAY_MS", 0);
    k_qp_err_after = knob("WEFT_IBEMU_QP_ERR_AFTER", 0);
    k_vanish_after = knob("WEFT_IBEMU_VANISH_AFTER", 0);
    k_cqe_delay_ns = knob("WEFT_IBEMU_CQE_DELAY_US", 0) * 1000;
    k_max_inline = (uint32_t)knob("WEFT_IBEMU_MAX_INLINE", MAX_INLINE_DEFAULT);
    k_refuse_dmabuf = knob("WEFT_IBEMU_REFUSE_DMABUF", 0);
    k_rem_access_after = knob("WEFT_IBEMU_REM_ACCESS_AFTER", 0);
    const char *dir = getenv("WEFT_IBEMU_DIR");
    int w = dir && *dir ? snprintf(g_dir, sizeof g_dir, "%s", dir)
                        : snprintf(g_dir, sizeof g_dir, "/tmp/weft-ibemu-%u", (unsigned)getuid());
    if (w < 0 || (size_t)w >= sizeof g_dir)
        return -ENAMETOOLONG;
    if (mkdir(g_dir, 0700) != 0 && errno != EEXIST)
        return -errno;
    sweep_stale();
    uint32_t pid = (uint32_t)getpid(), r = random32();
    memset(g_gid, 0, 16);
    g_gid[0] = 0xfe;
    g_gid[1] = 0x80;
    memcpy(g_gid + 8, &pid, 4);
    memcpy(g_gid + 12, &r, 4);
    gid_path(g_gid, g_path, sizeof g_path);
    g_listen = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (g_listen < 0)
        return -errno;
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", g_path);
    int sz = 4 << 20;
    setsockopt(g_listen, SOL_SOCKET, SO_RCVBUF, &sz, sizeof sz);
    if (bind(g_listen, (struct sockaddr *)&a, sizeof a) != 0 || listen(g_listen, 128) != 0) {
        int e = -errno;
        close(g_listen);
        g_listen = -1;
        return e;
    }
    if (pipe2(g_wake, O_NONBLOCK | O_CLOEXEC) != 0) {
        int e = -errno;
        close(g_listen);
        unlink(g_path);
        g_listen = -1;
        return e;
    }
    g_stop = 0;
    int rc = pthread_create(&g_thread, NULL, nic_main, NULL);
    if (rc) {
        close(g_listen);
        unlink(g_path);
        close(g_wake[0]);
        close(g_wake[1]);
        g_listen = g_wake[0] = g_wake[1] = -1;
        return -rc;
    }
    return 0;
}

static void nic_stop(void) {
    g_stop = 1;
    wake();
    pthread_mutex_unlock(&g_lock);
    pthread_join(g_thread, NULL);
    pthread_mutex_lock(&g_lock);
    close(g_listen);
    unlink(g_path);
    close(g_wake[0]);
    close(g_wake[1]);
    g_listen = g_wake[0] = g_wake[1] = -1;
    while (g_in) {
        struct inbound *i = g_in;
        g_in = i->next;
        close(i->fd);
        free(i);
    }
    while (g_conns) {
        struct conn *c = g_conns;
        g_conns = c->next;
        if (c->fd >= 0)
            close(c->fd);
        c->fd = -1;
        conn_flush(c);
        free(c);
    }
}

/* ---- the exported verbs ---- */

struct ibv_device **emu_get_device_list(int *num) EXPORT("ibv_get_device_list");
struct ibv_device **emu_get_device_list(int *num) {
    struct ibv_device **list = calloc(2, sizeof *list);
    if (!list) {
        errno = ENOMEM;
        return NULL;
    }
    pthread_mutex_lock(&g_lock);
    if (!g_device.name[0]) {
        snprintf(g_device.name, sizeof g_device.name, "weftemu0");
        snprintf(g_device.dev_name, sizeof g_device.dev_name, "uverbs-emu0");
        g_device.node_type = IBV_NODE_CA;
        g_device.transport_type = IBV_TRANSPORT_IB;
    }
    pthread_mutex_unlock(&g_lock);
    list[0] = &g_device;
    if (num)
        *num = 1;
    return list;
}

void emu_free_device_list(struct ibv_device **list) EXPORT("ibv_free_device_list");
void emu_free_device_list(struct ibv_device **list) { free(list); }

const char *emu_get_device_name(struct ibv_device *d) EXPORT("ibv_get_device_name");
const char *emu_get_device_name(struct ibv_device *d) { return d->name; }

static int emu_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad);
static int emu_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad);

struct ibv_context *emu_open_device(struct ibv_device *d) EXPORT("ibv_open_device");
struct ibv_context *emu_open_device(struct ibv_device *d) {
    if (d != &g_device) {
        errno = ENODEV;
        return NULL;
    }
    struct emu_ctx *c = calloc(1, sizeof *c);
    if (!c) {
        errno = ENOMEM;
        return NULL;
    }
    pthread_mutex_lock(&g_lock);
    if (g_refs == 0) {
        int rc = nic_start();
        if (rc) {
            pthread_mutex_unlock(&g_lock);
            free(c);
            errno = -rc;
            return NULL;
        }
    }
    g_refs++;
    pthread_mutex_unlock(&g_lock);
    c->ctx.device = d;
    c->ctx.cmd_fd = -1;
    c->ctx.async_fd = -1;
    c->ctx.num_comp_vectors = 1;
    c->ctx.abi_compat = NULL; /* not an extended context: the header's inline calls use ops */
    pthread_mutex_init(&c->ctx.mutex, NULL);
    c->ctx.ops.poll_cq = emu_poll_cq;
    c->ctx.ops.post_send = emu_post_send;
    c->ctx.ops.post_recv = emu_post_recv;
    return &c->ctx;
}

int emu_close_device(struct ibv_context *ctx) EXPORT("ibv_close_device");
int emu_close_device(struct ibv_context *ctx) {
    pthread_mutex_lock(&g_lock);
    if (--g_refs == 0)
        nic_stop();
    pthread_mutex_unlock(&g_lock);
    pthread_mutex_destroy(&ctx->mutex);
    free(ctx);
    return 0;
}

int emu_query_device(struct ibv_context *ctx, struct ibv_device_attr *a)
    EXPORT("ibv_query_device");
int emu_query_device(struct ibv_context *ctx, struct ibv_device_attr *a) {
    (void)ctx;
    memset(a, 0, sizeof *a);
    snprintf(a->fw_ver, sizeof a->fw_ver, "weft-emu");
    a->max_mr_size = UINT64_MAX;
    a->max_qp = 1 << 16;
    a->max_qp_wr = 1 << 15;
    a->max_sge = MAX_SGE;
    a->max_cq = 1 << 16;
    a->max_cqe = 1 << 20;
    a->max_mr = 1 << 20;
    a->max_pd = 1 << 16;
    a->max_qp_rd_atom = 16;
    a->max_qp_init_rd_atom = 16;
    a->phys_port_cnt = 1;
    return 0;
}

int emu_query_port(struct ibv_context *ctx, uint8_t port, void *out) EXPORT("ibv_query_port");
int emu_query_port(struct ibv_context *ctx, uint8_t port, void *out) {
    (void)ctx;
    if (port != 1)
        return EINVAL;
    struct ibv_port_attr a;
    memset(&a, 0, sizeof a);
    a.state = IBV_PORT_ACTIVE;
    a.max_mtu = IBV_MTU_4096;
    a.active_mtu = IBV_MTU_4096;
    a.gid_tbl_len = 1;
    a.max_msg_sz = 1u << 31;
    a.pkey_tbl_len = 1;
    a.phys_state = 5; /* LinkUp */
    a.link_layer = IBV_LINK_LAYER_ETHERNET;
    /* The compatible structure ends before port_cap_flags2. */
    memcpy(out, &a, offsetof(struct ibv_port_attr, port_cap_flags2));
    return 0;
}

int emu_query_gid(struct ibv_context *ctx, uint8_t port, int index, union ibv_gid *gid)
    EXPORT("ibv_query_gid");
int emu_query_gid(struct ibv_context *ctx, uint8_t port, int index, union ibv_gid *gid) {
    (void)ctx;
    if (port != 1 || index != 0)
        return EINVAL;
    pthread_mutex_lock(&g_lock);
    memcpy(gid->raw, g_gid, 16);
    pthread_mutex_unlock(&g_lock);
    return 0;
}

struct ibv_pd *emu_alloc_pd(struct ibv_context *ctx) EXPORT("ibv_alloc_pd");
struct ibv_pd *emu_alloc_pd(struct ibv_context *ctx) {
    struct ibv_pd *pd = calloc(1, sizeof *pd);
    if (!pd) {
        errno = ENOMEM;
        return NULL;
    }
    pd->context = ctx;
    return pd;
}

int emu_dealloc_pd(struct ibv_pd *pd) EXPORT("ibv_dealloc_pd");
int emu_dealloc_pd(struct ibv_pd *pd) {
    free(pd);
    return 0;
}

static struct ibv_mr *new_mr(struct ibv_pd *pd, unsigned char *host, uint64_t iova, size_t len,
                             int access, void *map, size_t map_len) {
    struct emu_mr *m = calloc(1, sizeof *m);
    if (!m) {
        errno = ENOMEM;
        return NULL;
    }
    m->mr.context = pd->context;
    m->mr.pd = pd;
    m->mr.addr = (void *)(uintptr_t)iova;
    m->mr.length = len;
    m->host = host;
    m->iova = iova;
    m->access = access;
    m->map = map;
    m->map_len = map_len;
    pthread_mutex_lock(&g_lock);
    uint32_t key;
    do
        key = random32();
    while (key == 0 || find_mr(key));
    m->mr.lkey = m->mr.rkey = key;
    m->next = g_mrs;
    g_mrs = m;
    pthread_mutex_unlock(&g_lock);
    return &m->mr;
}

struct ibv_mr *emu_reg_mr(struct ibv_pd *pd, void *addr, size_t len, int access)
    EXPORT("ibv_reg_mr");
struct ibv_mr *emu_reg_mr(struct ibv_pd *pd, void *addr, size_t len, int access) {
    if ((access & IBV_ACCESS_REMOTE_WRITE) && !(access & IBV_ACCESS_LOCAL_WRITE)) {
        errno = EINVAL;
        return NULL;
    }
    return new_mr(pd, addr, (uint64_t)(uintptr_t)addr, len, access, NULL, 0);
}

/* A dmabuf region: the emulator maps the descriptor (a memfd stands in for a device's dmabuf)
 * and requests name its bytes from `iova`. */
struct ibv_mr *emu_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t len, uint64_t iova,
                                 int fd, int access) EXPORT("ibv_reg_dmabuf_mr");
struct ibv_mr *emu_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t len, uint64_t iova,
                                 int fd, int access) {
    if (k_refuse_dmabuf) {
        errno = EOPNOTSUPP;
        return NULL;
    }
    long page = sysconf(_SC_PAGESIZE);
    uint64_t start = offset & ~(uint64_t)(page - 1);
    size_t map_len = (size_t)(offset - start) + len;
    void *map = mmap(NULL, map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)start);
    if (map == MAP_FAILED)
        return NULL;
    struct ibv_mr *mr =
        new_mr(pd, (unsigned char *)map + (offset - start), iova, len, access, map, map_len);
    if (!mr)
        munmap(map, map_len);
    return mr;
}

int emu_dereg_mr(struct ibv_mr *mr) EXPORT("ibv_dereg_mr");
int emu_dereg_mr(struct ibv_mr *mr) {
    struct emu_mr *m = (struct emu_mr *)mr;
    pthread_mutex_lock(&g_lock);
    LIST_UNLINK(struct emu_mr, g_mrs, m);
    /* A held placement into this region would write freed memory: drop those. */
    for (struct emu_qp *q = g_qps; q; q = q->next)
        for (struct held **hp = &q->held; *hp;) {
            struct held *h = *hp;
            if (h->dst >= m->host && h->dst < m->host + m->mr.length) {
                *hp = h->next;
                free(h);
            } else {
                hp = &h->next;
            }
        }
    for (struct emu_qp *q = g_qps; q; q = q->next) {
        q->held_tail = NULL;
        for (struct held *h = q->held; h; h = h->next)
            q->held_tail = h;
    }
    pthread_mutex_unlock(&g_lock);
    if (m->map)
        munmap(m->map, m->map_len);
    free(m);
    return 0;
}

struct ibv_cq *emu_create_cq(struct ibv_context *ctx, int cqe, void *cq_context,
                             struct ibv_comp_channel *ch, int vec) EXPORT("ibv_create_cq");
struct ibv_cq *emu_create_cq(struct ibv_context *ctx, int cqe, void *cq_context,
                             struct ibv_comp_channel *ch, int vec) {
    (void)vec;
    if (cqe < 1 || cqe > (1 << 20) || ch) {
        errno = EINVAL;
        return NULL;
    }
    struct emu_cq *c = calloc(1, sizeof *c);
    if (!c || !(c->ring = calloc((size_t)cqe, sizeof *c->ring))) {
        free(c);
        errno = ENOMEM;
        return NULL;
    }
    c->cap = cqe;
    c->cq.context = ctx;
    c->cq.cq_context = cq_context;
    c->cq.cqe = cqe;
    return &c->cq;
}

int emu_destroy_cq(struct ibv_cq *cq) EXPORT("ibv_destroy_cq");
int emu_destroy_cq(struct ibv_cq *cq) {
    struct emu_cq *c = (struct emu_cq *)cq;
    pthread_mutex_lock(&g_lock);
    for (struct emu_qp *q = g_qps; q; q = q->next)
        if (q->qp.send_cq == cq || q->qp.recv_cq == cq) {
            pthread_mutex_unlock(&g_lock);
            return EBUSY;
        }
    pthread_mutex_unlock(&g_lock);
    free(c->ring);
    free(c);
    return 0;
}

struct ibv_qp *emu_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *init)
    EXPORT("ibv_create_qp");
struct ibv_qp *emu_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *init) {
    if (init->qp_type != IBV_QPT_RC || !init->send_cq || !init->recv_cq || init->srq ||
        init->cap.max_send_wr < 1 || init->cap.max_send_wr > (1 << 15) ||
        init->cap.max_recv_wr > (1 << 15) || init->cap.max_send_sge > MAX_SGE ||
        init->cap.max_recv_sge > MAX_SGE || init->cap.max_inline_data > k_max_inline) {
        errno = EINVAL;
        return NULL;
    }
    struct emu_qp *q = calloc(1, sizeof *q);
    uint32_t rq = init->cap.max_recv_wr ? init->cap.max_recv_wr : 1;
    if (!q || !(q->rq = calloc(rq, sizeof *q->rq))) {
        free(q);
        errno = ENOMEM;
        return NULL;
    }
    q->max_send_wr = init->cap.max_send_wr;
    q->max_recv_wr = rq;
    q->max_inline = k_max_inline;
    init->cap.max_inline_data = k_max_inline;
    q->qp.context = pd->context;
    q->qp.qp_context = init->qp_context;
    q->qp.pd = pd;
    q->qp.send_cq = init->send_cq;
    q->qp.recv_cq = init->recv_cq;
    q->qp.state = IBV_QPS_RESET;
    q->qp.qp_type = IBV_QPT_RC;
    pthread_mutex_init(&q->qp.mutex, NULL);
    pthread_cond_init(&q->qp.cond, NULL);
    pthread_mutex_lock(&g_lock);
    uint32_t qpn;
    do
        qpn = random32() & 0xffffff;
    while (qpn < 2 || find_qp(qpn));
    q->qp.qp_num = qpn;
    q->next = g_qps;
    g_qps = q;
    pthread_mutex_unlock(&g_lock);
    return &q->qp;
}

static void qp_reset(struct emu_qp *q) {
    free_packets(q);
    free_held(q);
    while (q->sq) {
        struct swqe *w = q->sq;
        q->sq = w->next;
        free(w);
    }
    q->sq_tail = NULL;
    q->sq_count = 0;
    q->sq_unpolled = 0;
    q->rq_head = q->rq_count = 0;
    q->cur_recv_active = 0;
}

int emu_destroy_qp(struct ibv_qp *qp) EXPORT("ibv_destroy_qp");
int emu_destroy_qp(struct ibv_qp *qp) {
    struct emu_qp *q = (struct emu_qp *)qp;
    pthread_mutex_lock(&g_lock);
    LIST_UNLINK(struct emu_qp, g_qps, q);
    qp_reset(q);
    pthread_mutex_unlock(&g_lock);
    pthread_mutex_destroy(&qp->mutex);
    pthread_cond_destroy(&qp->cond);
    free(q->rq);
    free(q);
    return 0;
}

int emu_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *a, int mask) EXPORT("ibv_modify_qp");
int emu_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *a, int mask) {
    struct emu_qp *q = (struct emu_qp *)qp;
    if (!(mask & IBV_QP_STATE))
        return EINVAL;
    uint64_t delay_ms = 0;
    pthread_mutex_lock(&g_lock);
    enum ibv_qp_state from = qp->state, to = a->qp_state;
    int ok = 0;
    switch (to) {
    case IBV_QPS_RESET:
        qp_reset(q);
        ok = 1;
        break;
    case IBV_QPS_ERR:
        qp_error(q, IBV_WC_SUCCESS);
        pthread_mutex_unlock(&g_lock);
        return 0;
    case IBV_QPS_INIT:
        if ((from == IBV_QPS_RESET &&
             (mask & (IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) ==
                 (IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) &&
             a->port_num == 1) ||
            from == IBV_QPS_INIT) {
            if (mask & IBV_QP_ACCESS_FLAGS)
                q->access = (int)a->qp_access_flags;
            ok = 1;
        }
        break;
    case IBV_QPS_RTR: {
        int need = IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                   IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
        if (from == IBV_QPS_INIT && (mask & need) == need && a->ah_attr.is_global &&
            a->ah_attr.grh.sgid_index == 0) {
            memcpy(q->dgid, a->ah_attr.grh.dgid.raw, 16);
            q->dqpn = a->dest_qp_num & 0xffffff;
            q->epsn = q->placed = q->acked_to = a->rq_psn & 0xffffff;
            ok = 1;
            if (k_rtr_delay_ms && qp->qp_num > q->dqpn)
                delay_ms = k_rtr_delay_ms;
        }
        break;
    }
    case IBV_QPS_RTS: {
        int need = IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                   IBV_QP_MAX_QP_RD_ATOMIC;
        if (from == IBV_QPS_RTR && (mask & need) == need && a->timeout < 32 &&
            a->retry_cnt < 8 && a->rnr_retry < 8) {
            q->npsn = a->sq_psn & 0xffffff;
            q->timeout = a->timeout;
            q->retry_cnt = a->retry_cnt;
            q->rnr_retry = a->rnr_retry;
            q->retries_left = a->retry_cnt;
            q->rnr_left = a->rnr_retry;
            ok = 1;
        }
        break;
    }
    default:
        break;
    }
    pthread_mutex_unlock(&g_lock);
    if (!ok)
        return EINVAL;
    if (delay_ms) {
        /* The set-up race knob: this QP is slow to become ready to receive. */
        struct timespec t = {.tv_sec = (time_t)(delay_ms / 1000),
                             .tv_nsec = (long)(delay_ms % 1000) * 1000000L};
        nanosleep(&t, NULL);
    }
    pthread_mutex_lock(&g_lock);
    if (qp->state != IBV_QPS_ERR || to == IBV_QPS_RESET)
        qp->state = to;
    pthread_mutex_unlock(&g_lock);
    return 0;
}

static int post_one(struct emu_qp *q, struct ibv_send_wr *wr) {
    int op;
    switch (wr->opcode) {
    case IBV_WR_RDMA_WRITE:
        op = OP_WRITE;
        break;
    case IBV_WR_RDMA_WRITE_WITH_IMM:
        op = OP_WRITE_IMM;
        break;
    case IBV_WR_SEND:
        op = OP_SEND;
        break;
    default:
        return EINVAL;
    }
    if (wr->num_sge < 0 || wr->num_sge > MAX_SGE)
        return EINVAL;
    size_t total = 0;
    for (int i = 0; i < wr->num_sge; i++)
        total += wr->sg_list[i].length;
    int inl = (wr->send_flags & IBV_SEND_INLINE) != 0;
    if (inl && total > q->max_inline)
        return EINVAL;
    if (total > (1u << 31))
        return EINVAL;
    if (q->qp.state != IBV_QPS_RTS && q->qp.state != IBV_QPS_ERR)
        return EINVAL;
    if (q->sq_unpolled >= q->max_send_wr)
        return ENOMEM;
    struct swqe *w = calloc(1, sizeof *w);
    unsigned char *data = total ? malloc(total) : NULL;
    if (!w || (total && !data)) {
        free(w);
        free(data);
        return ENOMEM;
    }
    w->wr_id = wr->wr_id;
    w->op = op;
    w->signaled = (wr->send_flags & IBV_SEND_SIGNALED) != 0;
    w->byte_len = (uint32_t)total;
    q->sq_unpolled++;
    if (q->qp.state == IBV_QPS_ERR) {
        w->signaled = 1;
        complete_send(q, w, IBV_WC_WR_FLUSH_ERR);
        free(w);
        free(data);
        return 0;
    }
    q->posts++;
    if (k_qp_err_after && q->posts >= k_qp_err_after) {
        /* The forced-error knob: the QP fails under this work request. */
        QUEUE_PUSH(q->sq, q->sq_tail, w);
        q->sq_count++;
        free(data);
        qp_error(q, IBV_WC_FATAL_ERR);
        return 0;
    }
    if (k_vanish_after && !inl && total > SMALL)
        g_big_writes++;
    else if (k_vanish_after && total <= SMALL && g_big_writes >= k_vanish_after)
        _exit(41); /* the peer-vanishes knob: gone between the data and its flag */
    /* Gather the source now (a device reads it before the work request completes). */
    size_t at = 0;
    enum ibv_wc_status bad = IBV_WC_SUCCESS;
    for (int i = 0; i < wr->num_sge; i++) {
        struct ibv_sge *s = &wr->sg_list[i];
        const unsigned char *src = (const unsigned char *)(uintptr_t)s->addr;
        if (!inl) {
            struct emu_mr *m = find_mr(s->lkey);
            src = m && m->mr.pd == q->qp.pd ? mr_at(m, s->addr, s->length) : NULL;
            if (!src) {
                bad = IBV_WC_LOC_PROT_ERR;
                break;
            }
        }
        memcpy(data + at, src, s->length);
        at += s->length;
    }
    QUEUE_PUSH(q->sq, q->sq_tail, w);
    q->sq_count++;
    if (bad != IBV_WC_SUCCESS) {
        free(data);
        qp_error(q, bad);
        return 0;
    }
    /* Packets of at most PKT_MAX bytes, each with its sequence number. */
    size_t off = 0;
    do {
        size_t n = total - off < PKT_MAX ? total - off : PKT_MAX;
        struct pkt *p = malloc(sizeof *p + sizeof(struct hdr) + n);
        if (!p) {
            free(data);
            qp_error(q, IBV_WC_GENERAL_ERR);
            return 0;
        }
        struct hdr h;
        memset(&h, 0, sizeof h);
        h.magic = MAGIC;
        h.type = P_DATA;
        h.op = (uint8_t)op;
        memcpy(h.src_gid, g_gid, 16);
        h.src_qpn = q->qp.qp_num;
        h.dst_qpn = q->dqpn;
        h.psn = q->npsn;
        h.len = (uint32_t)n;
        h.raddr = wr->wr.rdma.remote_addr + off;
        h.rkey = wr->wr.rdma.rkey;
        h.imm = wr->imm_data;
        h.total = (uint32_t)total;
        h.offset = (uint32_t)off;
        h.last = off + n == total;
        memcpy(p->data, &h, sizeof h);
        if (n)
            memcpy(p->data + sizeof h, data + off, n);
        p->len = sizeof h + n;
        p->psn = q->npsn;
        p->wqe = w;
        QUEUE_PUSH(q->un, q->un_tail, p);
        w->last_psn = q->npsn;
        q->npsn = (q->npsn + 1) & 0xffffff;
        xmit(q->dgid, p->data, p->len);
        off += n;
    } while (off < total);
    free(data);
    if (!q->deadline)
        q->deadline = now_ns() + ack_timeout_ns(q);
    return 0;
}

static int emu_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad) {
    struct emu_qp *q = (struct emu_qp *)qp;
    pthread_mutex_lock(&g_lock);
    int rc = 0;
    for (; wr; wr = wr->next)
        if ((rc = post_one(q, wr)) != 0) {
            if (bad)
                *bad = wr;
            break;
        }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

static int emu_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad) {
    struct emu_qp *q = (struct emu_qp *)qp;
    pthread_mutex_lock(&g_lock);
    int rc = 0;
    for (; wr; wr = wr->next) {
        if (qp->state == IBV_QPS_RESET || wr->num_sge < 0 || wr->num_sge > MAX_SGE) {
            rc = EINVAL;
        } else if (qp->state == IBV_QPS_ERR) {
            struct ibv_wc wc = {.wr_id = wr->wr_id, .status = IBV_WC_WR_FLUSH_ERR,
                                .opcode = IBV_WC_RECV, .qp_num = qp->qp_num};
            cq_push(qp->recv_cq, &wc);
            continue;
        } else if (q->rq_count >= q->max_recv_wr) {
            rc = ENOMEM;
        }
        if (rc) {
            if (bad)
                *bad = wr;
            break;
        }
        struct rwqe *r = &q->rq[(q->rq_head + q->rq_count) % q->max_recv_wr];
        r->wr_id = wr->wr_id;
        r->nsge = wr->num_sge;
        memcpy(r->sge, wr->sg_list, (size_t)wr->num_sge * sizeof *wr->sg_list);
        q->rq_count++;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

const char *emu_wc_status_str(enum ibv_wc_status st) EXPORT("ibv_wc_status_str");
const char *emu_wc_status_str(enum ibv_wc_status st) {
    switch (st) {
    case IBV_WC_SUCCESS:
        return "success";
    case IBV_WC_LOC_LEN_ERR:
        return "local length error";
    case IBV_WC_LOC_PROT_ERR:
        return "local protection error";
    case IBV_WC_WR_FLUSH_ERR:
        return "Work Request Flushed Error";
    case IBV_WC_REM_ACCESS_ERR:
        return "remote access error";
    case IBV_WC_REM_INV_REQ_ERR:
        return "remote invalid request error";
    case IBV_WC_RETRY_EXC_ERR:
        return "transport retry counter exceeded";
    case IBV_WC_RNR_RETRY_EXC_ERR:
        return "RNR retry counter exceeded";
    case IBV_WC_FATAL_ERR:
        return "fatal error";
    case IBV_WC_GENERAL_ERR:
        return "general error";
    default:
        return "unknown";
    }
}
