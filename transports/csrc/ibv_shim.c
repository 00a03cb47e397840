/*
 * weftcc's bridge to InfiniBand / RoCE verbs (rdma-core's libibverbs).
 *
 * ibv_post_send and ibv_poll_cq are static inline calls through the context's operation table,
 * so Rust cannot bind them; this file compiles them against the system headers. The library's
 * exported functions are looked up with dlopen at run time, as NCCL does, so a weft binary starts
 * on machines without rdma-core and reports "no RDMA device".
 *
 * Every function returns 0 on success and a negative errno on failure.
 */
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <infiniband/verbs.h>

/* One loaded verbs library: its entry points. Libraries are loaded once per path and never
 * unloaded (contexts opened through one keep a pointer to it); a process may hold several
 * (the system's libibverbs.so.1 and the tests' emulated device). */
struct weft_ibv_lib {
    struct weft_ibv_lib *next;
    char path[4096];
    struct ibv_device **(*get_device_list)(int *);
    void (*free_device_list)(struct ibv_device **);
    const char *(*get_device_name)(struct ibv_device *);
    struct ibv_context *(*open_device)(struct ibv_device *);
    int (*close_device)(struct ibv_context *);
    int (*query_device)(struct ibv_context *, struct ibv_device_attr *);
    int (*query_port)(struct ibv_context *, uint8_t, struct _compat_ibv_port_attr *);
    int (*query_gid)(struct ibv_context *, uint8_t, int, union ibv_gid *);
    struct ibv_pd *(*alloc_pd)(struct ibv_context *);
    int (*dealloc_pd)(struct ibv_pd *);
    struct ibv_mr *(*reg_mr)(struct ibv_pd *, void *, size_t, int);
    /* NULL in rdma-core before v34 (no dmabuf support): registration falls back. */
    struct ibv_mr *(*reg_dmabuf_mr)(struct ibv_pd *, uint64_t, size_t, uint64_t, int, int);
    int (*dereg_mr)(struct ibv_mr *);
    struct ibv_cq *(*create_cq)(struct ibv_context *, int, void *, struct ibv_comp_channel *, int);
    int (*destroy_cq)(struct ibv_cq *);
    struct ibv_qp *(*create_qp)(struct ibv_pd *, struct ibv_qp_init_attr *);
    int (*destroy_qp)(struct ibv_qp *);
    int (*modify_qp)(struct ibv_qp *, struct ibv_qp_attr *, int);
    const char *(*wc_status_str)(enum ibv_wc_status);
};

static struct weft_ibv_lib *loaded;

#define LOAD(field, name)                                                                         \
    do {                                                                                          \
        *(void **)(&l->field) = dlsym(h, name);                                                   \
        if (!l->field) {                                                                          \
            snprintf(err, errlen, "%s lacks %s", want, name);                                     \
            dlclose(h);                                                                           \
            free(l);                                                                              \
            return -ENOSYS;                                                                       \
        }                                                                                         \
    } while (0)

/* Loads a verbs library once: `path` (WEFT_IB_LIBRARY, e.g. the emulated device of the tests),
 * or libibverbs.so.1 from the library search path when it is NULL; *out is the library
 * (callers serialize: providers are opened under a lock). */
int weft_ibv_load(const char *path, struct weft_ibv_lib **out, char *err, size_t errlen) {
    const char *want = path ? path : "libibverbs.so.1";
    for (struct weft_ibv_lib *l = loaded; l; l = l->next)
        if (strcmp(l->path, want) == 0) {
            *out = l;
            return 0;
        }
    struct weft_ibv_lib *l = calloc(1, sizeof *l);
    if (!l)
        return -ENOMEM;
    if (strlen(want) >= sizeof l->path) {
        snprintf(err, errlen, "library path of %zu bytes is too long", strlen(want));
        free(l);
        return -ENAMETOOLONG;
    }
    void *h = dlopen(want, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(err, errlen, "cannot load %s: %s", want, dlerror());
        free(l);
        return -ENOSYS;
    }
    LOAD(get_device_list, "ibv_get_device_list");
    LOAD(free_device_list, "ibv_free_device_list");
    LOAD(get_device_name, "ibv_get_device_name");
    LOAD(open_device, "ibv_open_device");
    LOAD(close_device, "ibv_close_device");
    LOAD(query_device, "ibv_query_device");
    LOAD(query_port, "ibv_query_port");
    LOAD(query_gid, "ibv_query_gid");
    LOAD(alloc_pd, "ibv_alloc_pd");
    LOAD(dealloc_pd, "ibv_dealloc_pd");
    LOAD(reg_mr, "ibv_reg_mr");
    LOAD(dereg_mr, "ibv_dereg_mr");
    LOAD(create_cq, "ibv_create_cq");
    LOAD(destroy_cq, "ibv_destroy_cq");
    LOAD(create_qp, "ibv_create_qp");
    LOAD(destroy_qp, "ibv_destroy_qp");
    LOAD(modify_qp, "ibv_modify_qp");
    LOAD(wc_status_str, "ibv_wc_status_str");
    *(void **)(&l->reg_dmabuf_mr) = dlsym(h, "ibv_reg_dmabuf_mr");
    snprintf(l->path, sizeof l->path, "%s", want);
    l->next = loaded;
    loaded = l;
    *out = l;
    return 0;
}

/* The names of the verbs devices, NUL-separated into names; their count, or -errno. */
int weft_ibv_devices(const struct weft_ibv_lib *l, char *names, size_t len) {
    int n = 0;
    errno = 0;
    struct ibv_device **list = l->get_device_list(&n);
    if (!list)
        return errno ? -errno : -ENODEV;
    size_t at = 0;
    int count = 0;
    for (int i = 0; i < n; i++) {
        const char *name = l->get_device_name(list[i]);
        size_t n_ = strlen(name) + 1;
        if (at + n_ > len)
            break;
        memcpy(names + at, name, n_);
        at += n_;
        count++;
    }
    l->free_device_list(list);
    return count;
}

struct weft_ibv_ctx {
    const struct weft_ibv_lib *lib;
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    int ports;
};

struct weft_ibv_port_info {
    uint32_t state;
    uint32_t link_layer;
    uint32_t active_mtu;
    uint32_t lid;
    uint32_t gid_table_len;
};

void weft_ibv_close(struct weft_ibv_ctx *c) {
    if (!c)
        return;
    if (c->pd)
        c->lib->dealloc_pd(c->pd);
    if (c->ctx)
        c->lib->close_device(c->ctx);
    free(c);
}

/* Opens device `name` with a protection domain; its port count in *ports. */
int weft_ibv_open(const struct weft_ibv_lib *l, const char *name, struct weft_ibv_ctx **out,
                  int *ports) {
    int n = 0;
    struct ibv_device **list = l->get_device_list(&n);
    if (!list)
        return errno ? -errno : -ENODEV;
    struct ibv_device *dev = NULL;
    for (int i = 0; i < n; i++)
        if (strcmp(l->get_device_name(list[i]), name) == 0)
            dev = list[i];
    struct weft_ibv_ctx *c = calloc(1, sizeof *c);
    int rc = 0;
    if (c)
        c->lib = l;
    if (!c)
        rc = -ENOMEM;
    else if (!dev)
        rc = -ENODEV;
    else if (!(c->ctx = l->open_device(dev)))
        rc = errno ? -errno : -EIO;
    l->free_device_list(list);
    if (rc) {
        free(c);
        return rc;
    }
    struct ibv_device_attr attr;
    memset(&attr, 0, sizeof attr);
    if ((rc = l->query_device(c->ctx, &attr)) != 0 || !(c->pd = l->alloc_pd(c->ctx))) {
        weft_ibv_close(c);
        return rc ? -abs(rc) : -ENOMEM;
    }
    c->ports = attr.phys_port_cnt;
    *ports = c->ports;
    *out = c;
    return 0;
}

int weft_ibv_port(struct weft_ibv_ctx *c, int port, struct weft_ibv_port_info *info) {
    struct ibv_port_attr attr;
    memset(&attr, 0, sizeof attr);
    /* As the header's inline ibv_query_port does: the extended call where the provider has it,
     * else the exported compatible one. */
    struct verbs_context *vctx = verbs_get_ctx_op(c->ctx, query_port);
    int rc = vctx ? vctx->query_port(c->ctx, port, &attr, sizeof attr)
                  : c->lib->query_port(c->ctx, port, (struct _compat_ibv_port_attr *)&attr);
    if (rc)
        return -abs(rc);
    info->state = attr.state;
    info->link_layer = attr.link_layer;
    info->active_mtu = attr.active_mtu;
    info->lid = attr.lid;
    info->gid_table_len = attr.gid_tbl_len;
    return 0;
}

int weft_ibv_gid(struct weft_ibv_ctx *c, int port, int index, uint8_t gid[16]) {
    union ibv_gid g;
    int rc = c->lib->query_gid(c->ctx, port, index, &g);
    if (rc)
        return -abs(rc);
    memcpy(gid, g.raw, 16);
    return 0;
}

int weft_ibv_reg(struct weft_ibv_ctx *c, void *buf, size_t len, struct ibv_mr **mr,
                 uint32_t *lkey, uint32_t *rkey) {
    *mr = c->lib->reg_mr(c->pd, buf, len, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    if (!*mr)
        return errno ? -errno : -ENOMEM;
    *lkey = (*mr)->lkey;
    *rkey = (*mr)->rkey;
    return 0;
}

/* Registers `len` bytes at `offset` of dmabuf `fd` (device memory a GPU driver exported), named
 * by `iova` in work requests. -EOPNOTSUPP where the library has no ibv_reg_dmabuf_mr. */
int weft_ibv_reg_dmabuf(struct weft_ibv_ctx *c, uint64_t offset, size_t len, uint64_t iova, int fd,
                        struct ibv_mr **mr, uint32_t *lkey, uint32_t *rkey) {
    if (!c->lib->reg_dmabuf_mr)
        return -EOPNOTSUPP;
    errno = 0;
    *mr = c->lib->reg_dmabuf_mr(c->pd, offset, len, iova, fd,
                                IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    if (!*mr)
        return errno ? -errno : -ENOMEM;
    *lkey = (*mr)->lkey;
    *rkey = (*mr)->rkey;
    return 0;
}

void weft_ibv_dereg(struct weft_ibv_ctx *c, struct ibv_mr *mr) {
    if (mr)
        c->lib->dereg_mr(mr);
}

const char *weft_ibv_status_str(struct weft_ibv_ctx *c, int status) {
    return c->lib->wc_status_str((enum ibv_wc_status)status);
}

struct weft_ibv_qp {
    const struct weft_ibv_lib *lib;
    struct ibv_qp *qp;
    struct ibv_cq *cq;
    int port;
};

void weft_ibv_qp_close(struct weft_ibv_qp *q) {
    if (!q)
        return;
    if (q->qp)
        q->lib->destroy_qp(q->qp);
    if (q->cq)
        q->lib->destroy_cq(q->cq);
    free(q);
}

/* A reliable-connection queue pair in INIT on `port`, with its own completion queue. */
int weft_ibv_qp_open(struct weft_ibv_ctx *c, int port, int depth, struct weft_ibv_qp **out,
                     uint32_t *qpn, uint32_t *max_inline) {
    struct weft_ibv_qp *q = calloc(1, sizeof *q);
    if (!q)
        return -ENOMEM;
    q->port = port;
    q->lib = c->lib;
    q->cq = c->lib->create_cq(c->ctx, depth, NULL, NULL, 0);
    if (!q->cq) {
        free(q);
        return errno ? -errno : -ENOMEM;
    }
    struct ibv_qp_init_attr init;
    memset(&init, 0, sizeof init);
    init.send_cq = q->cq;
    init.recv_cq = q->cq;
    init.qp_type = IBV_QPT_RC;
    init.cap.max_send_wr = depth;
    init.cap.max_recv_wr = 1;
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    /* Control words go inline where the device takes 64 bytes (16 are enough); a device that
     * takes less fails the creation, and the queue pair is made without inline data (the words
     * then go from registered slots). */
    init.cap.max_inline_data = 64;
    q->qp = c->lib->create_qp(c->pd, &init);
    if (!q->qp) {
        init.cap.max_inline_data = 0;
        q->qp = c->lib->create_qp(c->pd, &init);
    }
    if (!q->qp) {
        int e = errno ? -errno : -ENOMEM;
        weft_ibv_qp_close(q);
        return e;
    }
    struct ibv_qp_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.qp_state = IBV_QPS_INIT;
    attr.pkey_index = 0;
    attr.port_num = port;
    attr.qp_access_flags = IBV_ACCESS_REMOTE_WRITE;
    int rc = q->lib->modify_qp(q->qp, &attr,
                         IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
    if (rc) {
        weft_ibv_qp_close(q);
        return -abs(rc);
    }
    *qpn = q->qp->qp_num;
    *max_inline = init.cap.max_inline_data;
    *out = q;
    return 0;
}

/* What connecting to the peer's queue pair needs. */
struct weft_ibv_peer {
    uint32_t qpn;
    uint32_t psn;
    uint32_t lid;
    uint8_t gid[16];
    uint32_t use_gid; /* RoCE, or InfiniBand across subnets */
    uint32_t gid_index;
    uint32_t mtu;
    uint32_t timeout;
    uint32_t retry_cnt;
    uint32_t my_psn;
};

/* INIT → RTR → RTS towards the peer. */
int weft_ibv_qp_connect(struct weft_ibv_qp *q, const struct weft_ibv_peer *p) {
    struct ibv_qp_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.qp_state = IBV_QPS_RTR;
    attr.path_mtu = (enum ibv_mtu)p->mtu;
    attr.dest_qp_num = p->qpn;
    attr.rq_psn = p->psn;
    attr.max_dest_rd_atomic = 1;
    attr.min_rnr_timer = 12;
    attr.ah_attr.dlid = (uint16_t)p->lid;
    attr.ah_attr.port_num = q->port;
    if (p->use_gid) {
        attr.ah_attr.is_global = 1;
        memcpy(attr.ah_attr.grh.dgid.raw, p->gid, 16);
        attr.ah_attr.grh.sgid_index = p->gid_index;
        attr.ah_attr.grh.hop_limit = 255;
    }
    int rc = q->lib->modify_qp(q->qp, &attr,
                         IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                             IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
    if (rc)
        return -abs(rc);
    memset(&attr, 0, sizeof attr);
    attr.qp_state = IBV_QPS_RTS;
    attr.timeout = p->timeout;
    attr.retry_cnt = p->retry_cnt;
    attr.rnr_retry = 7;
    attr.sq_psn = p->my_psn;
    attr.max_rd_atomic = 1;
    rc = q->lib->modify_qp(q->qp, &attr,
                     IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                         IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
    return rc ? -abs(rc) : 0;
}

/* A signaled RDMA write; inline copies the bytes at post time. -ENOMEM when the queue is full. */
int weft_ibv_write(struct weft_ibv_qp *q, const void *buf, size_t len, uint32_t lkey,
                   uint64_t raddr, uint32_t rkey, uint64_t wr_id, int inline_data) {
    struct ibv_sge sge = {.addr = (uint64_t)(uintptr_t)buf, .length = (uint32_t)len, .lkey = lkey};
    struct ibv_send_wr wr, *bad = NULL;
    memset(&wr, 0, sizeof wr);
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.send_flags = IBV_SEND_SIGNALED | (inline_data ? IBV_SEND_INLINE : 0);
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = rkey;
    int rc = ibv_post_send(q->qp, &wr, &bad);
    return rc ? -abs(rc) : 0;
}

/* Up to max completions: ids and statuses (0 = success). Returns how many, or -errno. */
int weft_ibv_poll(struct weft_ibv_qp *q, uint64_t *ids, int32_t *status, int max) {
    struct ibv_wc wc[64];
    if (max > 64)
        max = 64;
    int n = ibv_poll_cq(q->cq, max, wc);
    if (n < 0)
        return -EIO;
    for (int i = 0; i < n; i++) {
        ids[i] = wc[i].wr_id;
        status[i] = (int32_t)wc[i].status;
    }
    return n;
}
