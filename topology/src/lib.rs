//! weftcc-topology: the machine model weftcc's algorithms are chosen from.
//!
//! * [`model`]: devices (GPUs, NICs, CPU/NUMA nodes), the path class between every pair
//!   (`NV#`, `PIX`, `PXB`, `PHB`, `NODE`, `SYS`), link speeds, and a typed graph with PCIe
//!   switches and NVSwitches ([`Topology::graph`]).
//! * Parsers: [`nvsmi::parse`] (`nvidia-smi topo -m`), [`xml::read`] / [`xml::write`] (NCCL's
//!   topology XML), [`nvml::to_topology`] (an NVML snapshot taken by [`nvml::capture`]) and
//!   [`discover::discover`] (sysfs, /sys/class/infiniband, GPUs from NVML, else `nvidia-smi`).
//! * [`search`]: rings that maximise the bottleneck bandwidth (several channels when links
//!   allow) and the double binary tree across hosts.
//! * [`tuner`]: the α-β cost model per (algorithm, protocol) and the `WEFT_ALGO` / `WEFT_PROTO`
//!   override syntax.
//! * [`netpath`]: the NIC each GPU uses between hosts and the GPUDirect RDMA distance limit
//!   (`WEFT_NET_GDR_LEVEL`, NCCL's syntax).
//! * [`report`]: warnings and the text / JSON / DOT / SVG renderings used by `weft topo`.
//!
//! Nothing here panics on malformed input: every parser returns a [`TopoError`].
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod discover;
pub mod error;
mod graph;
pub mod model;
pub mod netpath;
pub mod nvml;
pub mod nvsmi;
pub mod report;
pub mod search;
pub mod tuner;
pub mod xml;

pub use discover::host_id;
pub use error::{Result, TopoError};
pub use model::{
    class_rank, CpuNode, Gpu, GpuPairPath, GpuTransport, Graph, GraphLink, GraphNode, HostInfo,
    LinkKind, LinkSpeeds, Nic, NicKind, NodeKind, PathClass, RdmaPort, Topology,
};
