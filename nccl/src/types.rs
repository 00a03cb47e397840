//! NCCL's types and numbered values as its header `nccl.h` lays them out (the tests compile
//! static assertions of these against NVIDIA's header).

use std::ffi::{c_char, c_int, c_void};

/// Result of every call (NCCL's numbering).
pub type ncclResult_t = c_int;
pub const ncclSuccess: ncclResult_t = 0;
pub const ncclUnhandledCudaError: ncclResult_t = 1;
pub const ncclSystemError: ncclResult_t = 2;
pub const ncclInternalError: ncclResult_t = 3;
pub const ncclInvalidArgument: ncclResult_t = 4;
pub const ncclInvalidUsage: ncclResult_t = 5;
pub const ncclRemoteError: ncclResult_t = 6;
pub const ncclInProgress: ncclResult_t = 7;
/// NCCL 2.30's; weftcc's per-operation timeout (`WEFT_TIMEOUT`) returns it.
pub const ncclTimeout: ncclResult_t = 8;

/// Element types: NCCL's and weftcc's numbering are the same (`ncclFloat8e4m3` and
/// `ncclFloat8e5m2`, 10 and 11, are refused as unknown types).
pub type ncclDataType_t = c_int;
/// Reductions: the same numbering as weftcc's, `ncclRedOpCreatePreMulSum` handing out codes
/// from `ncclNumOps` (5) as NCCL does.
pub type ncclRedOp_t = c_int;
/// Where a `ncclRedOpCreatePreMulSum` scalar lives (`ncclScalarHostImmediate` = 1 supported).
pub type ncclScalarResidence_t = c_int;
/// A `cudaStream_t`: NULL for host buffers (weftcc's extension), else the stream the
/// operation is enqueued on.
pub type cudaStream_t = *mut c_void;

/// Bytes of an [`ncclUniqueId`].
pub const NCCL_UNIQUE_ID_BYTES: usize = 128;

/// NCCL's unique id: weftcc's (`weft1@HOST:PORT#TOKEN`) as NUL-terminated text.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclUniqueId {
    pub internal: [c_char; NCCL_UNIQUE_ID_BYTES],
}

/// `ncclConfig_t::magic` as `NCCL_CONFIG_INITIALIZER` sets it.
pub const NCCL_API_MAGIC: u32 = 0xcafe_beef;
/// A config field left undefined.
pub const NCCL_CONFIG_UNDEF_INT: c_int = c_int::MIN;
/// `ncclCommSplit`'s colour for a rank that joins no new communicator.
pub const NCCL_SPLIT_NOCOLOR: c_int = -1;

/// NCCL's `ncclConfig_t` as of 2.30 (`ncclConfig_v23000`). Programs built against an older
/// header pass a shorter struct (its `size`): a field is read only when the struct holds it.
/// weftcc uses `blocking` and `splitShare`; the others (kernel launch shapes, network and
/// traffic class, names) are accepted and have no effect.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ncclConfig_t {
    pub size: usize,
    pub magic: u32,
    pub version: u32,
    pub blocking: c_int,
    pub cgaClusterSize: c_int,
    pub minCTAs: c_int,
    pub maxCTAs: c_int,
    pub netName: *const c_char,
    pub splitShare: c_int,
    pub trafficClass: c_int,
    pub commName: *const c_char,
    pub collnetEnable: c_int,
    pub CTAPolicy: c_int,
    pub shrinkShare: c_int,
    pub nvlsCTAs: c_int,
    pub nChannelsPerNetPeer: c_int,
    pub nvlinkCentricSched: c_int,
    pub graphUsageMode: c_int,
    pub numRmaCtx: c_int,
    pub maxP2pPeers: c_int,
    pub graphStreamOrdering: c_int,
}

/// The fields of [`ncclConfig_t`] with their offsets, in order (the layout test compares each
/// with NVIDIA's header).
pub const CONFIG_FIELDS: &[(&str, usize)] = {
    use std::mem::offset_of;
    macro_rules! fields {
        ($($f:ident),*) => { &[$((stringify!($f), offset_of!(ncclConfig_t, $f))),*] };
    }
    fields!(
        size,
        magic,
        version,
        blocking,
        cgaClusterSize,
        minCTAs,
        maxCTAs,
        netName,
        splitShare,
        trafficClass,
        commName,
        collnetEnable,
        CTAPolicy,
        shrinkShare,
        nvlsCTAs,
        nChannelsPerNetPeer,
        nvlinkCentricSched,
        graphUsageMode,
        numRmaCtx,
        maxP2pPeers,
        graphStreamOrdering
    )
};

/// The NCCL version `ncclGetVersion` reports: 2.21.5 (`NCCL_VERSION(2,21,5)`), a release whose
/// API (communicator config, split, non-blocking communicators, pre-multiplied sums, user
/// buffer registration) frameworks look for. weftcc's own version is in
/// `ncclGetErrorString`'s texts and docs/nccl-dropin.md.
pub const NCCL_REPORTED_VERSION: c_int = 22105;
