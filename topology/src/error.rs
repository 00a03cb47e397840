//! Typed errors of the topology crate.

use thiserror::Error;

/// Everything that can go wrong while reading, discovering or searching a topology.
#[derive(Debug, Error)]
pub enum TopoError {
    /// An `nvidia-smi topo -m` text could not be understood.
    #[error("nvidia-smi topo -m{}: {msg}", line_part(.line))]
    NvidiaSmi {
        /// 1-based line number in the input (0 when the problem is not tied to one line).
        line: usize,
        /// What is wrong.
        msg: String,
    },
    /// An NCCL topology XML file could not be understood.
    #[error("NCCL topology XML: {0}")]
    Xml(String),
    /// A tuner override (WEFT_ALGO / WEFT_PROTO) or calibration could not be understood.
    #[error("tuner: {0}")]
    Tuner(String),
    /// The topology has no devices for the requested operation.
    #[error("topology: {0}")]
    Invalid(String),
    /// Reading a file or running a helper program failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or program.
        path: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// JSON (calibration files) could not be read or written.
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
}

fn line_part(line: &usize) -> String {
    if *line > 0 {
        format!(", line {line}")
    } else {
        String::new()
    }
}

impl TopoError {
    pub(crate) fn smi(line: usize, msg: impl Into<String>) -> Self {
        TopoError::NvidiaSmi {
            line,
            msg: msg.into(),
        }
    }
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, TopoError>;
