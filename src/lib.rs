//! weftcc: collective communication for training on many processes, GPUs and machines.
pub use weftcc_collectives::*;
