//! weftcc-ddp: data-parallel training on weftcc.
//!
//! * [`reducer`]: the gradient-bucketing reducer (PyTorch DDP's design): parameters grouped into
//!   buckets in reverse registration order, each bucket all-reduced asynchronously as soon as
//!   all its gradients are ready, buckets rebuilt after the first iteration in the order the
//!   gradients actually became ready, `no_sync` accumulation, unused parameters, compression
//!   hooks. Gradients live inside the bucket memory (no copy).
//! * [`model`], [`optim`], [`data`], [`checkpoint`], [`trainer`]: the reference consumer, a
//!   multilayer perceptron trained with SGD or AdamW on a synthetic set or MNIST-format files,
//!   with atomic checkpoints and resume (`weft train`).

#![forbid(unsafe_code)]

pub mod checkpoint;
pub mod data;
pub mod model;
pub mod optim;
pub mod reducer;
pub mod rng;
pub mod trainer;

pub use reducer::{CommHook, Reducer, ReducerConfig, ReducerError, StepTimings};
pub use trainer::{
    train, train_elastic, ElasticConfig, EpochStats, Point, Recovery, TrainConfig, TrainError,
    TrainReport,
};
