//! weftcc on NVIDIA GPUs.
//!
//! * [`driver`]: the "is there a CUDA driver" guard in front of every driver call
//!   ([`CudaError::NoDriver`] instead of cudarc's panic), devices, and the driver's P2P/NVLink
//!   matrix ([`p2p_matrix`]).
//! * [`Context`], [`Stream`], [`Event`], [`DeviceBuffer`], [`PinnedBuffer`]: owners of driver
//!   handles, usable from any thread.
//! * [`kernels`]: the reduction kernels for every data type and operation, CUDA C compiled once
//!   per process with NVRTC.
//! * [`DeviceComm`]: collectives on device buffers, enqueued on the caller's stream with NCCL's
//!   semantics, over CUDA IPC between ranks of one host or staged through pinned host memory
//!   into the host communicator otherwise.
//! * [`DeviceGroup`]: sends and receives on device buffers, grouped like NCCL's.
//! * [`gdr`]: GPUDirect RDMA between hosts: rings whose NIC writes device memory directly,
//!   run without a GPU on host memory standing in for it.
//!
//! The crate is built with cudarc's `dynamic-loading`: it builds and its tests pass (skipping
//! the GPU parts) on machines without CUDA.

pub mod comm;
pub mod driver;
pub mod error;
pub mod gdr;
pub mod group;
mod headers;
pub mod ipc;
pub mod kernels;
pub mod memory;
mod proxy;
mod staged;
#[doc(hidden)]
pub mod testing;
mod tiered;

pub use comm::{DeviceComm, Transport};
pub use driver::{
    device_count, device_info, device_of, devices, driver_present, driver_version, ensure_driver,
    gdr_support, p2p_matrix, p2p_report, DeviceInfo, GdrSupport, P2pLink,
};
pub use error::{CudaError, DeviceArgError, Result};
pub use group::DeviceGroup;
pub use ipc::{IpcHandle, IpcMapping};
pub use memory::{Context, DeviceBuffer, Event, MemoryKind, PinnedBuffer, Stream};
