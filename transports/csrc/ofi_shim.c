/*
 * weftcc's bridge to libfabric.
 *
 * libfabric's data-path calls (fi_write, fi_cq_read, fi_mr_reg, ...) are static inline
 * functions that call through the objects' operation tables, so Rust cannot bind them; this
 * file compiles them against the system headers. The library's few exported functions
 * (fi_getinfo, fi_freeinfo, fi_dupinfo, fi_fabric, fi_strerror) are looked up with dlopen at
 * run time, so a weft binary starts on machines without libfabric and reports "no libfabric".
 *
 * Every function returns 0 (or a count) on success and a negative libfabric error code on
 * failure; none keeps global state except the loaded library.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#ifdef FI_ORDER_RMA_WAW
#define WEFT_ORDER_WAW FI_ORDER_RMA_WAW
#else
#define WEFT_ORDER_WAW FI_ORDER_WAW
#endif

static int (*p_getinfo)(uint32_t, const char *, const char *, uint64_t, const struct fi_info *,
                        struct fi_info **);
static void (*p_freeinfo)(struct fi_info *);
static struct fi_info *(*p_dupinfo)(const struct fi_info *);
static int (*p_fabric)(struct fi_fabric_attr *, struct fid_fabric **, void *);
static const char *(*p_strerror)(int);

/* Loads libfabric once; 0, or -FI_ENOSYS with the loader's message in err. */
static int load(char *err, size_t errlen) {
    static void *lib;
    if (lib)
        return 0;
    void *h = dlopen("libfabric.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(err, errlen, "cannot load libfabric.so.1: %s", dlerror());
        return -FI_ENOSYS;
    }
    p_getinfo = dlsym(h, "fi_getinfo");
    p_freeinfo = dlsym(h, "fi_freeinfo");
    p_dupinfo = dlsym(h, "fi_dupinfo");
    p_fabric = dlsym(h, "fi_fabric");
    p_strerror = dlsym(h, "fi_strerror");
    if (!p_getinfo || !p_freeinfo || !p_dupinfo || !p_fabric || !p_strerror) {
        snprintf(err, errlen, "libfabric.so.1 lacks fi_getinfo/fi_fabric");
        dlclose(h);
        return -FI_ENOSYS;
    }
    lib = h;
    return 0;
}

const char *weft_ofi_strerror(int code) {
    if (!p_strerror)
        return "libfabric not loaded";
    return p_strerror(code < 0 ? -code : code);
}

uint32_t weft_ofi_header_version(void) {
    return FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION);
}

struct weft_ofi_domain {
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    uint64_t next_key;
};

/* Providers that are plain sockets or local memory, not RDMA hardware: they copy through the
 * registered addresses when bytes move instead of pinning pages. */
int weft_ofi_is_software(const char *prov) {
    static const char *soft[] = {"tcp", "sockets", "udp", "shm", "sm2", "net", NULL};
    size_t core = strcspn(prov, ";");
    for (int i = 0; soft[i]; i++)
        if (strlen(soft[i]) == core && strncmp(prov, soft[i], core) == 0)
            return 1;
    return 0;
}

/*
 * Opens the first provider (named prov, or any; with hardware_only, skipping software ones)
 * with reliable-datagram endpoints, RMA writes placed in order, and memory registration this
 * code can follow. Writes the provider's name into name.
 */
int weft_ofi_open(const char *prov, int hardware_only, struct weft_ofi_domain **out, char *name,
                  size_t namelen, char *err, size_t errlen) {
    int rc = load(err, errlen);
    if (rc)
        return rc;
    struct fi_info *hints = p_dupinfo(NULL);
    if (!hints) {
        snprintf(err, errlen, "fi_dupinfo failed");
        return -FI_ENOMEM;
    }
    hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE;
    hints->mode = 0;
    hints->ep_attr->type = FI_EP_RDM;
    hints->tx_attr->msg_order = WEFT_ORDER_WAW;
    /* A write completes once placed at the target, not when handed to a socket: a sender that
     * closes after its last completion then loses nothing in flight. */
    hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
    hints->rx_attr->msg_order = WEFT_ORDER_WAW;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
    hints->domain_attr->threading = FI_THREAD_SAFE;
    if (prov && *prov)
        hints->fabric_attr->prov_name = strdup(prov);
    struct fi_info *list = NULL;
    rc = p_getinfo(FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION), NULL, NULL, 0, hints, &list);
    p_freeinfo(hints);
    if (rc) {
        snprintf(err, errlen, "fi_getinfo: %s", p_strerror(-rc));
        return rc;
    }
    struct fi_info *pick = NULL;
    for (struct fi_info *i = list; i; i = i->next) {
        if (hardware_only && weft_ofi_is_software(i->fabric_attr->prov_name))
            continue;
        pick = i;
        break;
    }
    if (!pick) {
        snprintf(err, errlen, "no %sprovider with ordered RMA writes", hardware_only ? "RDMA " : "");
        p_freeinfo(list);
        return -FI_ENODATA;
    }
    struct weft_ofi_domain *d = calloc(1, sizeof *d);
    if (!d) {
        p_freeinfo(list);
        return -FI_ENOMEM;
    }
    d->info = p_dupinfo(pick);
    p_freeinfo(list);
    d->next_key = 1;
    if (!d->info) {
        free(d);
        return -FI_ENOMEM;
    }
    rc = p_fabric(d->info->fabric_attr, &d->fabric, NULL);
    if (rc) {
        snprintf(err, errlen, "fi_fabric: %s", p_strerror(-rc));
        p_freeinfo(d->info);
        free(d);
        return rc;
    }
    rc = fi_domain(d->fabric, d->info, &d->domain, NULL);
    if (rc) {
        snprintf(err, errlen, "fi_domain: %s", p_strerror(-rc));
        fi_close(&d->fabric->fid);
        p_freeinfo(d->info);
        free(d);
        return rc;
    }
    snprintf(name, namelen, "%s", d->info->fabric_attr->prov_name);
    *out = d;
    return 0;
}

void weft_ofi_close_domain(struct weft_ofi_domain *d) {
    if (!d)
        return;
    fi_close(&d->domain->fid);
    fi_close(&d->fabric->fid);
    p_freeinfo(d->info);
    free(d);
}

/* A registration, as weft_ofi_mr_reg fills it in. */
struct weft_ofi_mr {
    struct fid_mr *mr;
    uint64_t desc, key, base;
};

/* Registers `len` bytes at `buf` for remote writes: host memory (`cuda_device` < 0), or CUDA
 * device memory of device `cuda_device` through FI_HMEM (libfabric 1.17 names device memory by
 * address and interface; FI_MR_DMABUF, taking the dmabuf itself, came with 1.20), which is
 * -FI_EOPNOTSUPP where the domain has no FI_HMEM capability (tcp;ofi_rxm as opened here). */
int weft_ofi_mr_reg(struct weft_ofi_domain *d, void *buf, size_t len, int cuda_device,
                    struct weft_ofi_mr *out) {
    if (cuda_device >= 0 && !(d->info->caps & FI_HMEM))
        return -FI_EOPNOTSUPP;
    uint64_t requested = __atomic_fetch_add(&d->next_key, 1, __ATOMIC_RELAXED);
    struct iovec iov = {.iov_base = buf, .iov_len = len};
    struct fi_mr_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = FI_WRITE | FI_REMOTE_WRITE;
    attr.requested_key = requested;
    if (cuda_device >= 0) {
        attr.iface = FI_HMEM_CUDA;
        attr.device.cuda = cuda_device;
    }
    int rc = fi_mr_regattr(d->domain, &attr, 0, &out->mr);
    if (rc)
        return rc;
    uint64_t mode = d->info->domain_attr->mr_mode;
    out->desc = (uint64_t)(uintptr_t)fi_mr_desc(out->mr);
    out->key = (mode & FI_MR_PROV_KEY) ? fi_mr_key(out->mr) : requested;
    out->base = (mode & FI_MR_VIRT_ADDR) ? (uint64_t)(uintptr_t)buf : 0;
    return 0;
}

void weft_ofi_mr_close(struct fid_mr *mr) {
    if (mr)
        fi_close(&mr->fid);
}

struct weft_ofi_ep {
    struct fid_ep *ep;
    struct fid_cq *cq;
    struct fid_av *av;
    fi_addr_t peer;
    int connected;
};

void weft_ofi_ep_close(struct weft_ofi_ep *e) {
    if (!e)
        return;
    if (e->ep)
        fi_close(&e->ep->fid);
    if (e->av)
        fi_close(&e->av->fid);
    if (e->cq)
        fi_close(&e->cq->fid);
    free(e);
}

/* An enabled endpoint with its own completion queue and address vector. */
int weft_ofi_ep_open(struct weft_ofi_domain *d, struct weft_ofi_ep **out, uint64_t *depth,
                     uint64_t *inject) {
    struct weft_ofi_ep *e = calloc(1, sizeof *e);
    if (!e)
        return -FI_ENOMEM;
    struct fi_cq_attr cq_attr = {0};
    cq_attr.format = FI_CQ_FORMAT_CONTEXT;
    cq_attr.size = d->info->tx_attr->size ? d->info->tx_attr->size : 256;
    struct fi_av_attr av_attr = {0};
    av_attr.type = d->info->domain_attr->av_type == FI_AV_UNSPEC ? FI_AV_TABLE
                                                                 : d->info->domain_attr->av_type;
    av_attr.count = 1;
    int rc = fi_cq_open(d->domain, &cq_attr, &e->cq, NULL);
    if (!rc)
        rc = fi_av_open(d->domain, &av_attr, &e->av, NULL);
    if (!rc)
        rc = fi_endpoint(d->domain, d->info, &e->ep, NULL);
    if (!rc)
        rc = fi_ep_bind(e->ep, &e->cq->fid, FI_TRANSMIT | FI_RECV);
    if (!rc)
        rc = fi_ep_bind(e->ep, &e->av->fid, 0);
    if (!rc)
        rc = fi_enable(e->ep);
    if (rc) {
        weft_ofi_ep_close(e);
        return rc;
    }
    *depth = d->info->tx_attr->size;
    *inject = d->info->tx_attr->inject_size;
    *out = e;
    return 0;
}

int weft_ofi_ep_name(struct weft_ofi_ep *e, void *buf, size_t *len) {
    return fi_getname(&e->ep->fid, buf, len);
}

int weft_ofi_ep_connect(struct weft_ofi_ep *e, const void *addr) {
    int n = fi_av_insert(e->av, addr, 1, &e->peer, 0, NULL);
    if (n != 1)
        return n < 0 ? n : -FI_EADDRNOTAVAIL;
    e->connected = 1;
    return 0;
}

ssize_t weft_ofi_write(struct weft_ofi_ep *e, const void *buf, size_t len, uint64_t desc,
                       uint64_t raddr, uint64_t rkey, uint64_t ctx) {
    return fi_write(e->ep, buf, len, (void *)(uintptr_t)desc, e->peer, raddr, rkey,
                    (void *)(uintptr_t)ctx);
}

/* A write whose bytes are copied before the call returns; it still completes in the queue. */
ssize_t weft_ofi_write_inline(struct weft_ofi_ep *e, const void *buf, size_t len, uint64_t raddr,
                              uint64_t rkey, uint64_t ctx) {
    struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
    struct fi_rma_iov rma = {.addr = raddr, .len = len, .key = rkey};
    struct fi_msg_rma msg = {0};
    msg.msg_iov = &iov;
    msg.iov_count = 1;
    msg.addr = e->peer;
    msg.rma_iov = &rma;
    msg.rma_iov_count = 1;
    msg.context = (void *)(uintptr_t)ctx;
    /* Explicit flags replace the endpoint's defaults: ask for delivery again. */
    return fi_writemsg(e->ep, &msg, FI_INJECT | FI_COMPLETION | FI_DELIVERY_COMPLETE);
}

/*
 * Progresses the endpoint and reads up to max completions: their contexts into ctx and 0 or a
 * positive error code into status (its text into err for the first failure). Returns how many.
 */
ssize_t weft_ofi_poll(struct weft_ofi_ep *e, uint64_t *ctx, int64_t *status, size_t max,
                      char *err, size_t errlen) {
    struct fi_cq_entry entries[64];
    if (max > 64)
        max = 64;
    ssize_t n = fi_cq_read(e->cq, entries, max);
    if (n > 0) {
        for (ssize_t i = 0; i < n; i++) {
            ctx[i] = (uint64_t)(uintptr_t)entries[i].op_context;
            status[i] = 0;
        }
        return n;
    }
    if (n == -FI_EAGAIN)
        return 0;
    if (n != -FI_EAVAIL)
        return n;
    struct fi_cq_err_entry ee = {0};
    ssize_t r = fi_cq_readerr(e->cq, &ee, 0);
    if (r < 0)
        return r;
    ctx[0] = (uint64_t)(uintptr_t)ee.op_context;
    status[0] = ee.err ? ee.err : FI_EIO;
    snprintf(err, errlen, "%s", fi_cq_strerror(e->cq, ee.prov_errno, ee.err_data, NULL, 0));
    return 1;
}
