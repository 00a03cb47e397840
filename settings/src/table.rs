//! The table: one declaration per variable: name, kind, [`Agreement`] (whether every rank of a
//! job must set it alike), default and meaning. README.md's configuration table lists exactly these
//! (a test holds the two together).

use crate::{Agreement, Kind, Setting};

/// Declares each setting as a `pub static` and lists them all in [`ALL`].
macro_rules! settings {
    ($( $ident:ident = $name:literal, $kind:expr, $agreement:ident, $default:literal, $doc:literal; )*) => {
        $(
            #[doc = $doc]
            pub static $ident: Setting = Setting {
                name: $name,
                kind: $kind,
                agreement: Agreement::$agreement,
                default: $default,
                doc: $doc,
            };
        )*
        /// Every setting, in declaration order.
        pub static ALL: &[&Setting] = &[$(&$ident),*];
    };
}

use Kind::*;

settings! {
    // The communicator.
    TIMEOUT = "WEFT_TIMEOUT", Seconds, Should, "600",
        "Seconds an operation may go without progress before it fails with a timeout.";
    CONNECT = "WEFT_CONNECT", Text, Should, "on demand",
        "`eager` connects every pair of ranks at start-up instead of on first use.";
    SPLIT_SHARE = "WEFT_SPLIT_SHARE", Flag, Must, "off",
        "Splits share their parent's connections (every rank must set it alike).";
    DETERMINISTIC = "WEFT_DETERMINISTIC", Flag, Must, "off",
        "Floating-point reductions fold every element in rank order: bitwise identical results.";
    SLICE_BYTES = "WEFT_SLICE_BYTES", Size { min: 1 }, Must, "256K",
        "Largest message of a pipelined transfer.";
    ALGO = "WEFT_ALGO", Text, Must, "all",
        "Algorithms the tuner may pick, in NCCL_ALGO syntax.";
    PROTO = "WEFT_PROTO", Text, Must, "all",
        "Protocols, in NCCL_PROTO syntax.";
    CALIBRATION = "WEFT_CALIBRATION", Path, Must, "built-in figures",
        "Measured link figures for the tuner (a file from `weft topo --save-calibration`).";
    SPIN_US = "WEFT_SPIN_US", Micros, Own, "2",
        "Microseconds an idle rank spins before it yields the CPU.";
    YIELD_US = "WEFT_YIELD_US", Micros, Own, "1000",
        "Microseconds an idle rank yields the CPU before it sleeps.";
    NO_AVX512 = "WEFT_NO_AVX512", Flag, Should, "off",
        "f16/bf16 reductions use the portable kernels even where the CPU has AVX-512.";
    TRACE_BUFFER_SIZE = "WEFT_TRACE_BUFFER_SIZE", Number { min: 0, max: 1 << 24 }, Own, "2000",
        "Operations the flight recorder keeps per communicator (0: none).";
    TRACE_DUMP_DIR = "WEFT_TRACE_DUMP_DIR", Path, Own, "unset",
        "Directory the flight recorder is written to when a communicator fails.";
    RUN_DIAGNOSTICS = "WEFT_RUN_DIAGNOSTICS", Choice(&["0", "1", "FAIL"]), Must, "0",
        "`1`: a new communicator measures every pair of ranks as `weft doctor` does, and rank 0 logs the verdict; `FAIL`: init also fails when a pair is below `WEFT_DIAGNOSTICS_BELOW`.";
    DIAGNOSTICS_BELOW = "WEFT_DIAGNOSTICS_BELOW", Number { min: 1, max: 1000 }, Must, "50",
        "Percentage of the job's typical pair of its kind below which `WEFT_RUN_DIAGNOSTICS` calls a pair slow.";
    DEBUG = "WEFT_DEBUG", Choice(&["WARN", "INFO", "DEBUG", "TRACE", "OFF", "NONE", "VERSION"]), Own, "off",
        "Log level on stderr: WARN, INFO, DEBUG or TRACE (OFF, NONE or NCCL's VERSION: no log).";
    DEBUG_SUBSYS = "WEFT_DEBUG_SUBSYS", Text, Own, "all",
        "Subsystems to log: INIT, NET, SHM, BOOTSTRAP, OP, TUNING, ERROR, CUDA, TRACE (or ALL).";
    HOST_ID = "WEFT_HOST_ID", Text, Own, "hostname + boot id",
        "This host's identity: ranks with equal ids use shared memory.";
    CPU_BIND = "WEFT_CPU_BIND", Text, Own, "share",
        "`share`: each local rank its own equal block of the allowed CPUs (unbound when ranks outnumber them); `core` pins local rank k to the k-th allowed CPU; `none` leaves placement to the kernel.";

    // Shared memory.
    SHM_DISABLE = "WEFT_SHM_DISABLE", Flag, Must, "off",
        "Use TCP between ranks of one host.";
    BUFFSIZE = "WEFT_BUFFSIZE", Size { min: 1 }, Must, "1M",
        "Shared-memory ring per connected peer.";
    SHM_CMA = "WEFT_SHM_CMA", Flag, Must, "on",
        "The single-copy path (process_vm_readv); 0 sends every byte through the ring.";
    SHM_CMA_MIN = "WEFT_SHM_CMA_MIN", Size { min: 0 }, Must, "64K",
        "Smallest message sent by reference.";
    SHM_CMA_MAX_OP = "WEFT_SHM_CMA_MAX_OP", Size { min: 1 }, Must, "no bound",
        "Largest operation sent single-copy.";
    SHM_LL_MAX = "WEFT_SHM_LL_MAX", Size { min: 0 }, Must, "440",
        "Largest write sent as a low-latency message (0: none).";
    SHM_ONESHOT_MAX = "WEFT_SHM_ONESHOT_MAX", Size { min: 0 }, Must, "1K",
        "Small all-reduce, all-gather, reduce-scatter and all-to-all among 2 to 8 ranks that all share memory run one-shot (each rank posts its contribution, at most 4 KiB, once and reads the others' in place) when no rank reads more than this many bytes of the others' (0: never; unused when `WEFT_ALGO` is set).";

    // TCP.
    SOCKET_IFNAME = "WEFT_SOCKET_IFNAME", Text, Should, "all but lo, docker*",
        "Interfaces for TCP: prefixes, ^ excludes, = exact.";
    SOCKET_FAMILY = "WEFT_SOCKET_FAMILY", Text, Must, "IPv4 first",
        "AF_INET or AF_INET6.";
    SOCKET_NTHREADS = "WEFT_SOCKET_NTHREADS", Number { min: 0, max: 16 }, Must, "0",
        "Helper threads per TCP connection.";
    NSOCKS_PERTHREAD = "WEFT_NSOCKS_PERTHREAD", Number { min: 1, max: 64 }, Must, "1",
        "Sockets per helper thread.";

    // Networks with one-sided writes.
    NET = "WEFT_NET", Text, Must, "auto",
        "Network between hosts: ib, ofi, socket (or loopback, auto).";
    IB_DISABLE = "WEFT_IB_DISABLE", Flag, Must, "off",
        "No InfiniBand in the automatic choice.";
    IB_HCA = "WEFT_IB_HCA", Text, Own, "the first active port",
        "Verbs devices and ports, NCCL syntax.";
    IB_GID_INDEX = "WEFT_IB_GID_INDEX", Number { min: 0, max: 255 }, Should, "the first RoCE v2 IPv4 entry",
        "GID table entry for RoCE.";
    IB_TIMEOUT = "WEFT_IB_TIMEOUT", Number { min: 1, max: 31 }, Should, "20",
        "Queue-pair ACK timeout exponent.";
    IB_RETRY_CNT = "WEFT_IB_RETRY_CNT", Number { min: 0, max: 7 }, Should, "7",
        "Queue-pair retries before a write fails.";
    IB_LIBRARY = "WEFT_IB_LIBRARY", Path, Own, "libibverbs.so.1",
        "The verbs library to load (the tests' emulated RDMA device; never found by the search path).";
    IBEMU_DIR = "WEFT_IBEMU_DIR", Path, Own, "/tmp/weft-ibemu-<uid>",
        "Emulated RDMA device: directory of its NICs' sockets (path sockets reach other network namespaces).";
    IBEMU_DELAY_WRITES_US = "WEFT_IBEMU_DELAY_WRITES_US", Micros, Own, "0",
        "Emulated RDMA device: RDMA writes over 64 bytes placed this late, later small writes not held back (relaxed ordering).";
    IBEMU_RTR_DELAY_MS = "WEFT_IBEMU_RTR_DELAY_MS", Number { min: 0, max: 60000 }, Own, "0",
        "Emulated RDMA device: the larger-numbered queue pair of a connection reaches RTR this many ms late.";
    IBEMU_QP_ERR_AFTER = "WEFT_IBEMU_QP_ERR_AFTER", Number { min: 0, max: 1 << 40 }, Own, "0",
        "Emulated RDMA device: each queue pair goes to ERR at its n-th post (0: never).";
    IBEMU_VANISH_AFTER = "WEFT_IBEMU_VANISH_AFTER", Number { min: 0, max: 1 << 40 }, Own, "0",
        "Emulated RDMA device: the process exits (41) at its first small write after n large ones (0: never).";
    IBEMU_CQE_DELAY_US = "WEFT_IBEMU_CQE_DELAY_US", Micros, Own, "0",
        "Emulated RDMA device: completions become visible this late.";
    IBEMU_MAX_INLINE = "WEFT_IBEMU_MAX_INLINE", Number { min: 0, max: 1024 }, Own, "64",
        "Emulated RDMA device: largest inline payload of a queue pair.";
    IBEMU_REFUSE_DMABUF = "WEFT_IBEMU_REFUSE_DMABUF", Number { min: 0, max: 1 }, Own, "0",
        "Emulated RDMA device: 1 makes ibv_reg_dmabuf_mr fail with EOPNOTSUPP (no dmabuf support).";
    IBEMU_REM_ACCESS_AFTER = "WEFT_IBEMU_REM_ACCESS_AFTER", Number { min: 0, max: 1 << 40 }, Own, "0",
        "Emulated RDMA device: the n-th write packet over 64 bytes received is a remote access error (0: never).";
    IB_QPS_PER_CONNECTION = "WEFT_IB_QPS_PER_CONNECTION", Number { min: 1, max: 16 }, Must, "1",
        "Endpoints (queue pairs) per network connection.";
    OFI_PROVIDER = "WEFT_OFI_PROVIDER", Text, Must, "the first with RDMA hardware",
        "libfabric provider.";
    NET_BUFFSIZE = "WEFT_NET_BUFFSIZE", Size { min: 4096 }, Must, "2M",
        "Receive ring of each network connection (power of two, 4K to 1G).";
    NET_RNDV_THRESHOLD = "WEFT_NET_RNDV_THRESHOLD", Size { min: 0 }, Must, "0",
        "Smallest copied message a waiting receiver offers to be written straight into.";
    NET_GDR_LEVEL = "WEFT_NET_GDR_LEVEL", Text, Should, "PXB",
        "Farthest GPU-NIC path for GPUDirect RDMA: LOC, PIX, PXB, PHB, NODE, SYS or 0-4.";

    NCCL_INCLUDE = "WEFT_NCCL_INCLUDE", Path, Own, "found from pip's nvidia-nccl wheel",
        "Directory of NVIDIA's nccl.h for the NCCL drop-in's tests (`scripts/nccl_header.sh` fetches it; CI sets it, so the tests fail without it).";
    REQUIRE_NET_TESTS = "WEFT_REQUIRE_NET_TESTS", Flag, Own, "off",
        "Tests of the network providers (libfabric's tcp provider, the emulated RDMA device) fail instead of skipping when their prerequisite is missing (CI sets it).";
    REQUIRE_ETCD = "WEFT_REQUIRE_ETCD", Flag, Own, "off",
        "Tests of the etcd store fail instead of skipping when no `etcd` binary is on PATH (CI sets it).";

    // GPUs.
    CUDA_DISABLE = "WEFT_CUDA_DISABLE", Flag, Must, "off",
        "Act as if no CUDA driver were installed.";
    CUDA_IPC = "WEFT_CUDA_IPC", Flag, Must, "on",
        "CUDA IPC between the GPUs of a host; 0 forces the staged transport.";
    CUDA_HIERARCHICAL = "WEFT_CUDA_HIERARCHICAL", Flag, Must, "on",
        "IPC inside each host when ranks span hosts; 0 stages every operation.";
    CUDA_CHECK_HEADERS = "WEFT_CUDA_CHECK_HEADERS", Flag, Must, "on",
        "Operation headers exchanged on the IPC path (mismatch detection).";
    CUDA_STAGE_CHUNK = "WEFT_CUDA_STAGE_CHUNK", Size { min: 0 }, Must, "0",
        "Bytes per chunk of a staged all-reduce, broadcast or reduce (0: whole).";
    CUDA_SLOT_BYTES = "WEFT_CUDA_SLOT_BYTES", Size { min: 1 }, Must, "16M",
        "Bytes per IPC slot.";
    CUDA_DEPTH = "WEFT_CUDA_DEPTH", Number { min: 1, max: 64 }, Must, "2",
        "IPC slots per peer.";
    CUDA_RD_MAX = "WEFT_CUDA_RD_MAX", Size { min: 0 }, Must, "4M",
        "Largest all-reduce run by recursive doubling over IPC (0: always the ring).";
    CUDA_SHARD_MIN = "WEFT_CUDA_SHARD_MIN", Size { min: 0 }, Must, "128K",
        "Smallest hierarchical all-reduce sharded across hosts.";

    // Written by `weft run` for its workers.
    RANK = "WEFT_RANK", Launcher, Own, "",
        "This worker's rank.";
    WORLD_SIZE = "WEFT_WORLD_SIZE", Launcher, Own, "",
        "Ranks in the job.";
    LOCAL_RANK = "WEFT_LOCAL_RANK", Launcher, Own, "",
        "This worker's rank on its host.";
    LOCAL_WORLD_SIZE = "WEFT_LOCAL_WORLD_SIZE", Launcher, Own, "",
        "Ranks on this host.";
    MASTER_ADDR = "WEFT_MASTER_ADDR", Launcher, Own, "",
        "Address of the job's bootstrap store.";
    MASTER_PORT = "WEFT_MASTER_PORT", Launcher, Own, "",
        "Port of the job's bootstrap store.";
    JOB_TOKEN = "WEFT_JOB_TOKEN", Launcher, Own, "",
        "The job's token (authenticates to its store).";
    STORE = "WEFT_STORE", Launcher, Own, "",
        "A running bootstrap store (`host:port`) where the ranks meet instead of rank 0 serving one: `weft run` sets its own (node 0's launcher serves it); `weft store serve` starts one.";

    // The `weft` tool.
    UNIQUE_ID = "WEFT_UNIQUE_ID", Text, Own, "unset",
        "A job's unique id in a rank's environment: `weft status --pid` and `weft trace --pid` read it.";
    TRAIN_KILL_AT = "WEFT_TRAIN_KILL_AT", Text, Own, "unset",
        "`weft train` fault injection: `RANK:WHEN[,…]` kills the rank launched as RANK after step WHEN, or before it agrees, shrinks or grows (`agree`, `shrink`, `grow`) in an elastic run (first attempt).";
    ELASTIC_JOIN = "WEFT_ELASTIC_JOIN", Text, Own, "unset",
        "`1`: a replacement that `weft run --elastic` started: `weft train --elastic` joins the running job by grow instead of taking a rank.";

    // The tests.
    FUZZ_CASES = "WEFT_FUZZ_CASES", Number { min: 1, max: 1 << 31 }, Own, "1000",
        "Cases per target of the fuzz tests (`transports/tests/fuzz.rs`, `topology/tests/fuzz.rs`).";
    TEST_VERSION = "WEFT_TEST_VERSION", Text, Own, "this build's",
        "The library version this rank announces when a communicator is made (the consistency tests fake an older build with it).";
    TEST_BUILD_ID = "WEFT_TEST_BUILD_ID", Text, Own, "this build's",
        "The library build id this rank announces when a communicator is made (the consistency tests fake another build with it).";
    TEST_NET_PROVIDER = "WEFT_TEST_NET_PROVIDER", Text, Own, "the resolved one",
        "The network provider this rank announces when a communicator is made (the consistency tests fake another host's choice with it).";
}

/// NCCL's variables that mean what a `WEFT_*` one means, in the same grammar: honoured, the
/// `WEFT_*` one winning, in processes that use weftcc's `libnccl.so.2`
/// ([`crate::honour_nccl_twins`]). docs/nccl-dropin.md lists them (a test holds the two
/// together).
pub static NCCL_TWINS: &[(&Setting, &str)] = &[
    (&DEBUG, "NCCL_DEBUG"),
    (&DEBUG_SUBSYS, "NCCL_DEBUG_SUBSYS"),
    (&ALGO, "NCCL_ALGO"),
    (&PROTO, "NCCL_PROTO"),
    (&SHM_DISABLE, "NCCL_SHM_DISABLE"),
    (&SOCKET_IFNAME, "NCCL_SOCKET_IFNAME"),
    (&SOCKET_FAMILY, "NCCL_SOCKET_FAMILY"),
    (&SOCKET_NTHREADS, "NCCL_SOCKET_NTHREADS"),
    (&NSOCKS_PERTHREAD, "NCCL_NSOCKS_PERTHREAD"),
    (&IB_DISABLE, "NCCL_IB_DISABLE"),
    (&IB_HCA, "NCCL_IB_HCA"),
    (&IB_GID_INDEX, "NCCL_IB_GID_INDEX"),
    (&IB_TIMEOUT, "NCCL_IB_TIMEOUT"),
    (&IB_RETRY_CNT, "NCCL_IB_RETRY_CNT"),
    (&NET_GDR_LEVEL, "NCCL_NET_GDR_LEVEL"),
];
