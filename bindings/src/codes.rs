//! The C ABI's numbered values: result codes, data types, reduction operations and operation
//! kinds, each a plain `int` with named values (NCCL's numbering where NCCL has one).

use std::ffi::c_int;

/// Result of every call (NCCL's codes 0–7, then weftcc's own). The three enumerations are plain
/// `int`s with named values, so a value C passes in that is not one of them is an error, not
/// undefined behaviour.
pub type weftResult_t = c_int;
pub const weftSuccess: weftResult_t = 0;
pub const weftUnhandledCudaError: weftResult_t = 1;
/// The operating system or a transport failed (sockets, shared memory, bootstrap).
pub const weftSystemError: weftResult_t = 2;
/// A bug in weftcc (an invariant broke, or a panic was caught).
pub const weftInternalError: weftResult_t = 3;
/// A bad argument: null pointer, unknown type or operation, rank, root or peer out of range,
/// overlapping buffers. Nothing was sent; the communicator stays usable.
pub const weftInvalidArgument: weftResult_t = 4;
/// A call out of order (group calls unbalanced).
pub const weftInvalidUsage: weftResult_t = 5;
/// Another rank failed, died, timed out, aborted or called a different collective; this rank
/// learnt of it (the message names that rank and what happened there).
pub const weftRemoteError: weftResult_t = 6;
pub const weftInProgress: weftResult_t = 7;
/// An operation of this rank made no progress within the timeout (`WEFT_TIMEOUT`, or the
/// config's `timeoutMs`); the message names the ranks that are behind.
pub const weftTimeout: weftResult_t = 8;
/// `weftCommAbort` was called on this communicator (on this rank; another rank's abort is a
/// `weftRemoteError` here).
pub const weftAborted: weftResult_t = 9;

/// Element types (NCCL's numbering).
pub type weftDataType_t = c_int;
pub const weftInt8: weftDataType_t = 0;
pub const weftUint8: weftDataType_t = 1;
pub const weftInt32: weftDataType_t = 2;
pub const weftUint32: weftDataType_t = 3;
pub const weftInt64: weftDataType_t = 4;
pub const weftUint64: weftDataType_t = 5;
pub const weftFloat16: weftDataType_t = 6;
pub const weftFloat32: weftDataType_t = 7;
pub const weftFloat64: weftDataType_t = 8;
pub const weftBfloat16: weftDataType_t = 9;

/// Reduction operations (NCCL's numbering).
pub type weftRedOp_t = c_int;
pub const weftSum: weftRedOp_t = 0;
pub const weftProd: weftRedOp_t = 1;
pub const weftMax: weftRedOp_t = 2;
pub const weftMin: weftRedOp_t = 3;
pub const weftAvg: weftRedOp_t = 4;
/// The number of built-in reductions; [`weftRedOpCreatePreMulSum`] hands out codes from here.
pub const weftNumOps: weftRedOp_t = 5;

/// Operations named by [`weftErrorInfo_t::op`] (weftcc's wire codes; 0: none).
pub type weftOpKind_t = c_int;
pub const weftOpNone: weftOpKind_t = 0;
pub const weftOpAllReduce: weftOpKind_t = 1;
pub const weftOpReduce: weftOpKind_t = 2;
pub const weftOpBroadcast: weftOpKind_t = 3;
pub const weftOpAllGather: weftOpKind_t = 4;
pub const weftOpReduceScatter: weftOpKind_t = 5;
pub const weftOpAllToAll: weftOpKind_t = 6;
pub const weftOpSendRecv: weftOpKind_t = 7;
pub const weftOpBarrier: weftOpKind_t = 8;
