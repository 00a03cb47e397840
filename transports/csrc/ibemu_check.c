/*
 * Checks of the emulated RDMA device (csrc/ibemu.c) through the verbs API itself, for what the
 * weft provider does not use: SEND and receives, RDMA_WRITE_WITH_IMM, receiver-not-ready,
 * relaxed placement seen from the responder, completion-queue overflow, ibv_reg_dmabuf_mr, the
 * queue-pair state machine and the inline limit. Run by tests/verbs_emulated.rs as
 * `ibemu_check <path of the emulator>`; prints one line per check and exits non-zero on the
 * first failure.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <infiniband/verbs.h>

static struct ibv_device **(*get_device_list)(int *);
static struct ibv_context *(*open_device)(struct ibv_device *);
static int (*close_device)(struct ibv_context *);
static int (*query_gid)(struct ibv_context *, uint8_t, int, union ibv_gid *);
static struct ibv_pd *(*alloc_pd)(struct ibv_context *);
static int (*dealloc_pd)(struct ibv_pd *);
static struct ibv_mr *(*reg_mr)(struct ibv_pd *, void *, size_t, int);
static struct ibv_mr *(*reg_dmabuf_mr)(struct ibv_pd *, uint64_t, size_t, uint64_t, int, int);
static int (*dereg_mr)(struct ibv_mr *);
static struct ibv_cq *(*create_cq)(struct ibv_context *, int, void *, struct ibv_comp_channel *,
                                   int);
static int (*destroy_cq)(struct ibv_cq *);
static struct ibv_qp *(*create_qp)(struct ibv_pd *, struct ibv_qp_init_attr *);
static int (*destroy_qp)(struct ibv_qp *);
static int (*modify_qp)(struct ibv_qp *, struct ibv_qp_attr *, int);

static int checks;
#define CHECK(cond, ...)                                                                          \
    do {                                                                                          \
        if (!(cond)) {                                                                            \
            fprintf(stderr, "FAILED %s:%d: %s: ", __FILE__, __LINE__, #cond);                     \
            fprintf(stderr, __VA_ARGS__);                                                         \
            fprintf(stderr, "\n");                                                                \
            exit(1);                                                                              \
        }                                                                                         \
        checks++;                                                                                 \
    } while (0)

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static union ibv_gid gid;

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

struct end {
    struct ibv_cq *cq;
    struct ibv_qp *qp;
};

static struct end make_end(int cqe, int inline_bytes) {
    struct end e;
    e.cq = create_cq(ctx, cqe, NULL, NULL, 0);
    CHECK(e.cq, "create_cq");
    struct ibv_qp_init_attr init;
    memset(&init, 0, sizeof init);
    init.send_cq = init.recv_cq = e.cq;
    init.qp_type = IBV_QPT_RC;
    init.cap.max_send_wr = 16;
    init.cap.max_recv_wr = 16;
    init.cap.max_send_sge = init.cap.max_recv_sge = 1;
    init.cap.max_inline_data = (uint32_t)inline_bytes;
    e.qp = create_qp(pd, &init);
    CHECK(e.qp, "create_qp");
    return e;
}

static void to_init(struct ibv_qp *qp) {
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_INIT;
    a.port_num = 1;
    a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
    CHECK(modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) ==
              0,
          "to INIT");
}

static void to_rts(struct ibv_qp *qp, uint32_t dest, uint8_t rnr_retry) {
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = IBV_MTU_4096;
    a.dest_qp_num = dest;
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = gid;
    a.ah_attr.port_num = 1;
    CHECK(modify_qp(qp, &a,
                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                        IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) == 0,
          "to RTR");
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = rnr_retry;
    CHECK(modify_qp(qp, &a,
                    IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                        IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC) == 0,
          "to RTS");
}

static void connect_pair(struct end *a, struct end *b) {
    to_init(a->qp);
    to_init(b->qp);
    to_rts(a->qp, b->qp->qp_num, 7);
    to_rts(b->qp, a->qp->qp_num, 7);
}

static void free_end(struct end *e) {
    CHECK(destroy_qp(e->qp) == 0, "destroy_qp");
    CHECK(destroy_cq(e->cq) == 0, "destroy_cq");
}

/* One completion of `cq` within 5 s. */
static struct ibv_wc wait_wc(struct ibv_cq *cq) {
    struct ibv_wc wc;
    double end = now_ms() + 5000;
    for (;;) {
        int n = ibv_poll_cq(cq, 1, &wc);
        CHECK(n >= 0, "poll_cq: %d", n);
        if (n == 1)
            return wc;
        CHECK(now_ms() < end, "no completion within 5 s");
        usleep(100);
    }
}

static int post_write(struct ibv_qp *qp, enum ibv_wr_opcode op, void *buf, uint32_t len,
                      uint32_t lkey, uint64_t raddr, uint32_t rkey, uint64_t id, int flags) {
    struct ibv_sge sge = {.addr = (uintptr_t)buf, .length = len, .lkey = lkey};
    struct ibv_send_wr wr, *bad;
    memset(&wr, 0, sizeof wr);
    wr.wr_id = id;
    wr.sg_list = &sge;
    wr.num_sge = len ? 1 : 0;
    wr.opcode = op;
    wr.send_flags = IBV_SEND_SIGNALED | (unsigned)flags;
    wr.imm_data = 0x12345678;
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = rkey;
    return ibv_post_send(qp, &wr, &bad);
}

static void post_recv(struct ibv_qp *qp, void *buf, uint32_t len, uint32_t lkey, uint64_t id) {
    struct ibv_sge sge = {.addr = (uintptr_t)buf, .length = len, .lkey = lkey};
    struct ibv_recv_wr wr, *bad;
    memset(&wr, 0, sizeof wr);
    wr.wr_id = id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    CHECK(ibv_post_recv(qp, &wr, &bad) == 0, "post_recv");
}

/* Ends a check of two connected ends: releases their registrations, buffers and ends, and says
 * what held ("ok: ..."). */
static void finish(struct end *a, struct end *b, struct ibv_mr *ms, struct ibv_mr *md, void *src,
                   void *dst, const char *held) {
    dereg_mr(ms);
    dereg_mr(md);
    free(src);
    free(dst);
    free_end(a);
    free_end(b);
    printf("ok: %s\n", held);
}

static void check_state_machine_and_inline(void) {
    struct end a = make_end(16, 64);
    char buf[128] = {0};
    CHECK(post_write(a.qp, IBV_WR_RDMA_WRITE, buf, 8, 0, 0, 0, 1, IBV_SEND_INLINE) == EINVAL,
          "posting in RESET");
    struct ibv_qp_attr at;
    memset(&at, 0, sizeof at);
    at.qp_state = IBV_QPS_RTR;
    CHECK(modify_qp(a.qp, &at, IBV_QP_STATE) == EINVAL, "RESET to RTR");
    struct ibv_qp_init_attr init;
    memset(&init, 0, sizeof init);
    init.send_cq = init.recv_cq = a.cq;
    init.qp_type = IBV_QPT_RC;
    init.cap.max_send_wr = 4;
    init.cap.max_inline_data = 65;
    CHECK(create_qp(pd, &init) == NULL, "a queue pair with 65 inline bytes");
    struct end b = make_end(16, 64);
    connect_pair(&a, &b);
    CHECK(post_write(a.qp, IBV_WR_RDMA_WRITE, buf, 65, 0, 0, 0, 1, IBV_SEND_INLINE) == EINVAL,
          "65 bytes inline");
    free_end(&a);
    free_end(&b);
    printf("ok: state machine (EINVAL before RTS, RESET->RTR refused), inline limit 64\n");
}

static void check_send_and_rnr(void) {
    struct end a = make_end(16, 64), b = make_end(16, 64);
    connect_pair(&a, &b);
    char *src = calloc(1, 4096), *dst = calloc(1, 4096);
    memset(src, 0x33, 100);
    struct ibv_mr *ms = reg_mr(pd, src, 4096, IBV_ACCESS_LOCAL_WRITE);
    struct ibv_mr *md = reg_mr(pd, dst, 4096, IBV_ACCESS_LOCAL_WRITE);
    CHECK(ms && md, "reg_mr");
    /* No receive posted: receiver not ready; resent until one is (rnr_retry 7: forever). */
    CHECK(post_write(a.qp, IBV_WR_SEND, src, 100, ms->lkey, 0, 0, 7, 0) == 0, "post SEND");
    usleep(20000);
    struct ibv_wc wc;
    CHECK(ibv_poll_cq(a.cq, 1, &wc) == 0, "a SEND completed before a receive was posted");
    post_recv(b.qp, dst, 4096, md->lkey, 9);
    wc = wait_wc(b.cq);
    CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV && wc.wr_id == 9 &&
              wc.byte_len == 100,
          "receive: status %d opcode %d len %u", wc.status, wc.opcode, wc.byte_len);
    CHECK(memcmp(dst, src, 100) == 0 && dst[100] == 0, "received bytes");
    wc = wait_wc(a.cq);
    CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_SEND && wc.wr_id == 7, "send done");
    /* A SEND longer than the receive: remote invalid request. */
    post_recv(b.qp, dst, 10, md->lkey, 10);
    CHECK(post_write(a.qp, IBV_WR_SEND, src, 100, ms->lkey, 0, 0, 8, 0) == 0, "post SEND");
    wc = wait_wc(a.cq);
    CHECK(wc.status == IBV_WC_REM_INV_REQ_ERR, "status %d", wc.status);
    finish(&a, &b, ms, md, src, dst,
           "SEND waits for a receive (RNR), lands with its length; too long: "
           "IBV_WC_REM_INV_REQ_ERR");
}

static void check_relaxed_placement_and_imm(void) {
    /* WEFT_IBEMU_DELAY_WRITES_US=20000 (set by main before the device opened). */
    struct end a = make_end(16, 64), b = make_end(16, 64);
    connect_pair(&a, &b);
    char *src = calloc(1, 8192);
    volatile char *dst = calloc(1, 8192);
    memset(src, 0x44, 4096);
    struct ibv_mr *ms = reg_mr(pd, src, 8192, IBV_ACCESS_LOCAL_WRITE);
    struct ibv_mr *md = reg_mr(pd, (void *)dst, 8192,
                               IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    CHECK(ms && md, "reg_mr");
    uint64_t base = (uintptr_t)dst;
    char flag[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    post_recv(b.qp, NULL, 0, 0, 77);
    CHECK(post_write(a.qp, IBV_WR_RDMA_WRITE, src, 4096, ms->lkey, base, md->rkey, 1, 0) == 0,
          "data");
    CHECK(post_write(a.qp, IBV_WR_RDMA_WRITE, flag, 8, 0, base + 4096, md->rkey, 2,
                     IBV_SEND_INLINE) == 0,
          "flag");
    CHECK(post_write(a.qp, IBV_WR_RDMA_WRITE_WITH_IMM, NULL, 0, 0, base, md->rkey, 3, 0) == 0,
          "imm");
    double end = now_ms() + 5000;
    while (dst[4096] != 1 && now_ms() < end) {
    }
    CHECK(dst[4096] == 1, "the flag never landed");
    CHECK(dst[0] == 0 && dst[4095] == 0, "the flag was seen before its data: not relaxed");
    struct ibv_wc wc = wait_wc(b.cq);
    CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM &&
              wc.wr_id == 77 && (wc.wc_flags & IBV_WC_WITH_IMM) && wc.imm_data == 0x12345678,
          "imm completion: status %d opcode %d", wc.status, wc.opcode);
    CHECK(dst[0] == 0x44 && dst[4095] == 0x44, "the immediate's completion before the data");
    for (int k = 1; k <= 3; k++) {
        wc = wait_wc(a.cq);
        CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == (uint64_t)k, "write %d completed", k);
    }
    finish(&a, &b, ms, md, src, (void *)dst,
           "relaxed placement (a flag seen before its data), write-with-immediate completes "
           "after every earlier write is placed");
}

static void check_cq_overflow(void) {
    struct end a = make_end(2, 64), b = make_end(16, 64);
    connect_pair(&a, &b);
    char *dst = calloc(1, 64);
    struct ibv_mr *md = reg_mr(pd, dst, 64, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    char word[8] = {0};
    for (int k = 0; k < 4; k++)
        CHECK(post_write(a.qp, IBV_WR_RDMA_WRITE, word, 8, 0, (uintptr_t)dst, md->rkey,
                         (uint64_t)k, IBV_SEND_INLINE) == 0,
              "post %d", k);
    usleep(50000);
    struct ibv_wc wc[4];
    int n = ibv_poll_cq(a.cq, 4, wc);
    CHECK(n < 0, "a completion queue of 2 took 4 completions: %d", n);
    dereg_mr(md);
    free(dst);
    free_end(&a);
    free_end(&b);
    printf("ok: completion queue overflow is an error of every later poll\n");
}

static void check_dmabuf(void) {
    int fd = memfd_create("weft-ibemu-check", 0);
    CHECK(fd >= 0 && ftruncate(fd, 8192) == 0, "memfd");
    uint64_t iova = 0x100000000ull;
    struct ibv_mr *m = reg_dmabuf_mr(pd, 4096, 4096, iova, fd,
                                     IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    CHECK(m && m->rkey, "reg_dmabuf_mr");
    struct end a = make_end(16, 64), b = make_end(16, 64);
    connect_pair(&a, &b);
    char word[8] = {7, 7, 7, 7, 7, 7, 7, 7};
    CHECK(post_write(a.qp, IBV_WR_RDMA_WRITE, word, 8, 0, iova + 100, m->rkey, 1,
                     IBV_SEND_INLINE) == 0,
          "post");
    struct ibv_wc wc = wait_wc(a.cq);
    CHECK(wc.status == IBV_WC_SUCCESS, "status %d", wc.status);
    char *view = mmap(NULL, 8192, PROT_READ, MAP_SHARED, fd, 0);
    CHECK(view != MAP_FAILED && view[4096 + 100] == 7 && view[4096 + 99] == 0,
          "the bytes at the region's offset of the buffer");
    CHECK(post_write(a.qp, IBV_WR_RDMA_WRITE, word, 8, 0, iova + 4092, m->rkey, 2,
                     IBV_SEND_INLINE) == 0,
          "post");
    wc = wait_wc(a.cq);
    CHECK(wc.status == IBV_WC_REM_ACCESS_ERR, "past the dmabuf region: status %d", wc.status);
    munmap(view, 8192);
    dereg_mr(m);
    close(fd);
    free_end(&a);
    free_end(&b);
    printf("ok: ibv_reg_dmabuf_mr places at iova, bounded by the region\n");
}

#define SYM(v, name)                                                                              \
    do {                                                                                          \
        *(void **)(&v) = dlsym(lib, name);                                                        \
        CHECK(v, "%s missing", name);                                                             \
    } while (0)

int main(int argc, char **argv) {
    CHECK(argc == 2, "usage: ibemu_check <libweft_ibemu.so>");
    setenv("WEFT_IBEMU_DELAY_WRITES_US", "20000", 1);
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    CHECK(lib, "dlopen: %s", dlerror());
    SYM(get_device_list, "ibv_get_device_list");
    SYM(open_device, "ibv_open_device");
    SYM(close_device, "ibv_close_device");
    SYM(query_gid, "ibv_query_gid");
    SYM(alloc_pd, "ibv_alloc_pd");
    SYM(dealloc_pd, "ibv_dealloc_pd");
    SYM(reg_mr, "ibv_reg_mr");
    SYM(reg_dmabuf_mr, "ibv_reg_dmabuf_mr");
    SYM(dereg_mr, "ibv_dereg_mr");
    SYM(create_cq, "ibv_create_cq");
    SYM(destroy_cq, "ibv_destroy_cq");
    SYM(create_qp, "ibv_create_qp");
    SYM(destroy_qp, "ibv_destroy_qp");
    SYM(modify_qp, "ibv_modify_qp");
    void (*free_device_list)(struct ibv_device **);
    SYM(free_device_list, "ibv_free_device_list");
    int n = 0;
    struct ibv_device **list = get_device_list(&n);
    CHECK(list && n == 1, "one device");
    ctx = open_device(list[0]);
    CHECK(ctx, "open_device");
    free_device_list(list);
    pd = alloc_pd(ctx);
    CHECK(pd && query_gid(ctx, 1, 0, &gid) == 0, "pd, gid");
    check_state_machine_and_inline();
    check_send_and_rnr();
    check_relaxed_placement_and_imm();
    check_cq_overflow();
    check_dmabuf();
    CHECK(dealloc_pd(pd) == 0 && close_device(ctx) == 0, "close");
    printf("ibemu check: %d checks passed\n", checks);
    return 0;
}
