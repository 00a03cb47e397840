//! The collectives, sends and receives (each becoming its `weft*` call, now or at the group's
//! end) and the pre-multiplied-sum reductions.

use std::ffi::{c_int, c_void};

use weft::{
    weftAllGather, weftAllReduce, weftAllToAll, weftBroadcast, weftComm_t, weftRecv,
    weftRedOpCreatePreMulSum, weftRedOpDestroy, weftReduce, weftReduceScatter, weftSend,
};

use crate::errors::{check, run, Outcome};
use crate::group::submit;
use crate::handle::{comm_arc, ncclComm_t};
use crate::types::*;

/// Runs `job` with weftcc's handle of `comm` now or at the group's end; the pointers the job
/// uses travel as addresses (valid until the call or its group ended: NCCL's contract).
///
/// # Safety
/// `comm` is null or live.
unsafe fn on(
    comm: ncclComm_t,
    call: &'static str,
    job: impl FnOnce(weftComm_t) -> weft::weftResult_t + Send + 'static,
) -> Outcome {
    // SAFETY: per the contract.
    let c = unsafe { comm_arc(comm, call) }?;
    submit(c, call, Box::new(job))
}

/// An argument as it travels to the call's group end: a pointer as its address (pointers are not
/// `Send`; NCCL's contract keeps what they point at valid until the call or its group ended).
trait Carry: Copy {
    type Sent: Copy + Send + 'static;
    fn sent(self) -> Self::Sent;
    fn back(sent: Self::Sent) -> Self;
}

// Numbers as they are, pointers as addresses.
macro_rules! carry {
    ($($t:ty => $sent:ty),*) => {$(
        impl Carry for $t {
            type Sent = $sent;
            fn sent(self) -> $sent {
                self as $sent
            }
            fn back(sent: $sent) -> Self {
                sent as Self
            }
        }
    )*};
}

carry!(c_int => c_int, usize => usize, *const c_void => usize, *mut c_void => usize);

/// NCCL's `$name`, with NCCL's arguments and then `comm` and `stream`: weftcc's `$weft` with the
/// arguments listed (then weftcc's communicator and the stream), now or at the group's end.
macro_rules! forward {
    ($(
        $(#[$doc:meta])*
        fn $name:ident($($arg:ident: $ty:ty),*) => $weft:ident($($pass:ident),*);
    )*) => {$(
        $(#[$doc])*
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            $($arg: $ty,)*
            comm: ncclComm_t,
            stream: cudaStream_t,
        ) -> ncclResult_t {
            $(let $arg = Carry::sent($arg);)*
            let stream = Carry::sent(stream);
            // SAFETY: per the contract, passed on to weftcc's call.
            run(|| unsafe {
                on(comm, stringify!($name), move |w| {
                    $(let $arg = <$ty as Carry>::back($arg);)*
                    $weft($($pass,)* w, Carry::back(stream))
                })
            })
        }
    )*};
}

forward! {
    /// All-reduce of `count` elements; in place when `sendbuff == recvbuff`.
    ///
    /// # Safety
    /// NCCL's: buffers of `count` elements valid until the call (host) or the stream (device)
    /// completed; `comm` live.
    fn ncclAllReduce(
        sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t,
        op: ncclRedOp_t
    ) => weftAllReduce(sendbuff, recvbuff, count, datatype, op);

    /// Broadcast from `root`; in place when equal.
    ///
    /// # Safety
    /// As [`ncclAllReduce`].
    fn ncclBroadcast(
        sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t,
        root: c_int
    ) => weftBroadcast(sendbuff, recvbuff, count, datatype, root);

    /// NCCL's in-place broadcast (legacy form).
    ///
    /// # Safety
    /// As [`ncclAllReduce`].
    fn ncclBcast(buff: *mut c_void, count: usize, datatype: ncclDataType_t, root: c_int)
        => weftBroadcast(buff, buff, count, datatype, root);

    /// Reduce into `root`'s `recvbuff`.
    ///
    /// # Safety
    /// As [`ncclAllReduce`].
    fn ncclReduce(
        sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t,
        op: ncclRedOp_t, root: c_int
    ) => weftReduce(sendbuff, recvbuff, count, datatype, op, root);

    /// All-gather of `sendcount` elements per rank.
    ///
    /// # Safety
    /// As [`ncclAllReduce`], `recvbuff` of nranks × `sendcount`.
    fn ncclAllGather(
        sendbuff: *const c_void, recvbuff: *mut c_void, sendcount: usize, datatype: ncclDataType_t
    ) => weftAllGather(sendbuff, recvbuff, sendcount, datatype);

    /// Reduce-scatter into `recvcount` elements per rank.
    ///
    /// # Safety
    /// As [`ncclAllReduce`], `sendbuff` of nranks × `recvcount`.
    fn ncclReduceScatter(
        sendbuff: *const c_void, recvbuff: *mut c_void, recvcount: usize, datatype: ncclDataType_t,
        op: ncclRedOp_t
    ) => weftReduceScatter(sendbuff, recvbuff, recvcount, datatype, op);

    /// All-to-all of `count` elements per pair of ranks (NCCL 2.28).
    ///
    /// # Safety
    /// As [`ncclAllReduce`], both buffers of nranks × `count`.
    fn ncclAlltoAll(
        sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t
    ) => weftAllToAll(sendbuff, recvbuff, count, datatype);

    /// Sends `count` elements to `peer` (in a group, with the group's other calls).
    ///
    /// # Safety
    /// As [`ncclAllReduce`].
    fn ncclSend(sendbuff: *const c_void, count: usize, datatype: ncclDataType_t, peer: c_int)
        => weftSend(sendbuff, count, datatype, peer);

    /// Receives `count` elements from `peer`.
    ///
    /// # Safety
    /// As [`ncclAllReduce`].
    fn ncclRecv(recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, peer: c_int)
        => weftRecv(recvbuff, count, datatype, peer);
}

/// A reduction multiplying each input by `*scalar` before summing (host-immediate scalars).
///
/// # Safety
/// `op` null or writable; `scalar` null or one readable element; `comm` null or live.
#[no_mangle]
pub unsafe extern "C" fn ncclRedOpCreatePreMulSum(
    op: *mut ncclRedOp_t,
    scalar: *mut c_void,
    datatype: ncclDataType_t,
    residence: ncclScalarResidence_t,
    comm: ncclComm_t,
) -> ncclResult_t {
    let call = "ncclRedOpCreatePreMulSum";
    run(|| {
        // SAFETY: per the contract.
        let c = unsafe { comm_arc(comm, call) }?;
        // SAFETY: per the contract, passed on (weftcc checks the arguments).
        check(unsafe { weftRedOpCreatePreMulSum(op, scalar, datatype, residence, c.weft(call)?) })
    })
}

/// Destroys a reduction made by [`ncclRedOpCreatePreMulSum`].
///
/// # Safety
/// `comm` null or live.
#[no_mangle]
pub unsafe extern "C" fn ncclRedOpDestroy(op: ncclRedOp_t, comm: ncclComm_t) -> ncclResult_t {
    let call = "ncclRedOpDestroy";
    run(|| {
        // SAFETY: per the contract.
        let c = unsafe { comm_arc(comm, call) }?;
        // SAFETY: live while `c` holds it.
        check(unsafe { weftRedOpDestroy(op, c.weft(call)?) })
    })
}
