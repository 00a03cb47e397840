//! Reduction operations from C: the built-in codes and the pre-multiplied sums a communicator
//! hands out (NCCL's `ncclRedOpCreatePreMulSum`).

use std::ffi::{c_int, c_void};

use weftcc_collectives::{CallError, OpKind, ReduceOp};

use crate::boundary::{dtype_of, entry, handle_ref, write_out};
use crate::codes::{
    weftAvg, weftDataType_t, weftMax, weftMin, weftNumOps, weftProd, weftRedOp_t, weftResult_t,
    weftSuccess, weftSum,
};
use crate::errors::{arg_error, bad_arg};
use crate::handle::{weftComm, weftComm_t};

/// Where a [`weftRedOpCreatePreMulSum`] scalar lives (NCCL's `ncclScalarResidence_t`).
pub type weftScalarResidence_t = c_int;
/// In device memory: read by the GPU when the operation runs (needs the CUDA path).
pub const weftScalarDevice: weftScalarResidence_t = 0;
/// In host memory, read once when the reduction is created.
pub const weftScalarHostImmediate: weftScalarResidence_t = 1;

/// Creates a reduction that multiplies each input by `*scalar` (of `datatype`) before summing
/// (NCCL's `ncclRedOpCreatePreMulSum`), valid on `comm` until [`weftRedOpDestroy`]. Only
/// [`weftScalarHostImmediate`] is supported: the scalar is read now.
///
/// # Safety
/// `op` is null or writable; `scalar` is null or points to one readable `datatype` element;
/// `comm` is null or a live handle.
#[no_mangle]
pub unsafe extern "C" fn weftRedOpCreatePreMulSum(
    op: *mut weftRedOp_t,
    scalar: *const c_void,
    datatype: weftDataType_t,
    residence: weftScalarResidence_t,
    comm: weftComm_t,
) -> weftResult_t {
    entry(|| {
        // SAFETY: per the contract.
        let h = unsafe { handle_ref(comm) }?;
        let c = &h.comm;
        let kind = OpKind::AllReduce;
        let dt = dtype_of(c, kind, datatype)?;
        let call = "weftRedOpCreatePreMulSum";
        if residence != weftScalarHostImmediate {
            return Err(bad_arg(format!(
                "rank {}: {call}: residence {residence}: only weftScalarHostImmediate ({}) is \
                 supported (a device-resident scalar needs the CUDA path)",
                c.rank(),
                weftScalarHostImmediate
            )));
        }
        if scalar.is_null() {
            return Err(bad_arg(format!("rank {}: {call}: null scalar", c.rank())));
        }
        // SAFETY: `scalar` points to one readable element of `dt`, per the contract.
        let bytes = unsafe { std::slice::from_raw_parts(scalar.cast::<u8>(), dt.size()) };
        let factor = dt.decode_f64(bytes).ok_or_else(|| {
            bad_arg(format!(
                "rank {}: {call}: the scalar is not a {dt} value",
                c.rank()
            ))
        })?;
        let code = {
            let mut table = premul_table(h);
            let slot = match table.iter().position(Option::is_none) {
                Some(i) => i,
                None => {
                    table.push(None);
                    table.len() - 1
                }
            };
            let code = c_int::try_from(slot)
                .ok()
                .and_then(|s| s.checked_add(weftNumOps))
                .ok_or_else(|| bad_arg(format!("{call}: too many reductions")))?;
            table[slot] = Some(factor);
            code
        };
        // SAFETY: per the contract.
        unsafe { write_out(op, code, call) }
    })
}

/// Destroys a reduction made by [`weftRedOpCreatePreMulSum`] on `comm` (its code may be handed
/// out again). Built-in reductions cannot be destroyed.
///
/// # Safety
/// `comm` is null or a live handle.
#[no_mangle]
pub unsafe extern "C" fn weftRedOpDestroy(op: weftRedOp_t, comm: weftComm_t) -> weftResult_t {
    entry(|| {
        // SAFETY: per the contract.
        let h = unsafe { handle_ref(comm) }?;
        let mut table = premul_table(h);
        let slot = op
            .checked_sub(weftNumOps)
            .and_then(|i| usize::try_from(i).ok())
            .and_then(|i| table.get_mut(i))
            .filter(|s| s.is_some());
        match slot {
            Some(s) => {
                *s = None;
                Ok(weftSuccess)
            }
            None => Err(bad_arg(format!(
                "rank {}: weftRedOpDestroy: {op} is not a reduction created on this communicator",
                h.comm.rank()
            ))),
        }
    })
}

pub(crate) fn op_of(h: &weftComm, kind: OpKind, op: c_int) -> Result<ReduceOp, weftResult_t> {
    let c = &h.comm;
    Ok(match op {
        weftSum => ReduceOp::Sum,
        weftProd => ReduceOp::Prod,
        weftMax => ReduceOp::Max,
        weftMin => ReduceOp::Min,
        weftAvg => ReduceOp::Avg,
        _ => {
            let scalar = op
                .checked_sub(weftNumOps)
                .and_then(|i| usize::try_from(i).ok())
                .and_then(|i| premul_table(h).get(i).copied().flatten());
            match scalar {
                Some(factor) => ReduceOp::PreMulSum(factor),
                None => {
                    let code = op.into();
                    return Err(arg_error(c, kind, CallError::UnknownReduction { code }));
                }
            }
        }
    })
}

fn premul_table(h: &weftComm) -> std::sync::MutexGuard<'_, Vec<Option<f64>>> {
    h.premul.lock().unwrap_or_else(|e| e.into_inner())
}
