//! The opaque communicator handle (`weftComm_t`): the communicator and what the C layer keeps
//! beside it.

use std::sync::Arc;

use weftcc_comm::Communicator;
use weftcc_cuda::DeviceComm;

/// A communicator (opaque).
pub struct weftComm {
    pub(crate) comm: Communicator,
    /// Scalars of the reductions made by [`weftRedOpCreatePreMulSum`], by `op - weftNumOps`;
    /// `None` once destroyed.
    pub(crate) premul: std::sync::Mutex<Vec<Option<f64>>>,
    /// The device communicator behind calls with a stream, made by the first of them.
    pub(crate) device: std::sync::Mutex<Option<Arc<DeviceComm>>>,
}

/// Handle to a communicator.
pub type weftComm_t = *mut weftComm;

impl weftComm {
    /// A new handle owning `comm`, with nothing kept beside it yet; `weftCommDestroy` frees it.
    pub(crate) fn into_handle(comm: Communicator) -> weftComm_t {
        Box::into_raw(Box::new(weftComm {
            comm,
            premul: Default::default(),
            device: Default::default(),
        }))
    }
}
