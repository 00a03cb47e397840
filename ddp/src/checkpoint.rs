//! Checkpoints: written atomically (temporary file, fsync, rename, fsync of the directory),
//! with a checksum so that a torn or foreign file is refused rather than half-loaded.
//!
//! Format: `WEFTCKPT` magic, format version (u32 LE), metadata length (u64 LE), metadata
//! (JSON), tensor count (u64 LE), then per tensor its length (u64 LE) and f32 LE values, and
//! finally an FNV-1a 64 checksum (u64 LE) of everything before it. Floats are stored as raw
//! bits, so a resumed run continues bit for bit.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::optim::OptimizerKind;
use crate::rng::Rng;

const MAGIC: &[u8; 8] = b"WEFTCKPT";
const VERSION: u32 = 1;

/// Errors reading or writing checkpoints.
#[derive(Debug, Error)]
pub enum CheckpointError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a valid checkpoint: {reason}")]
    Corrupt { path: PathBuf, reason: String },
}

/// Everything besides the tensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    /// Optimizer steps completed.
    pub step: u64,
    /// Epoch of the next step.
    pub epoch: u64,
    /// Step within that epoch of the next step.
    pub step_in_epoch: u64,
    /// Seed of the run (sampler and initialisation).
    pub seed: u64,
    /// Element counts of the parameters (checked on load).
    pub param_sizes: Vec<usize>,
    pub optimizer: OptimizerKind,
    /// Optimizer step count.
    pub optimizer_t: u64,
    /// The trainer's random generator.
    pub rng: Rng,
    /// The reducer's bucket order (parameter indices), if rebuilt.
    pub bucket_order: Option<Vec<usize>>,
    /// World size that wrote it.
    pub world_size: usize,
}

/// A checkpoint: metadata, parameters, optimizer buffers.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    pub meta: Meta,
    pub params: Vec<Vec<f32>>,
    /// Optimizer first buffers then second buffers (`m` then `v`).
    pub opt_m: Vec<Vec<f32>>,
    pub opt_v: Vec<Vec<f32>>,
}

fn fnv(h: &mut u64, data: &[u8]) {
    for &b in data {
        *h ^= b as u64;
        *h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
}

/// File name of the checkpoint after `step` steps.
pub fn file_name(step: u64) -> String {
    format!("ckpt-{step:010}.weft")
}

impl Checkpoint {
    /// Serialises to bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        let meta = serde_json::to_vec(&self.meta).unwrap_or_default();
        out.extend_from_slice(&(meta.len() as u64).to_le_bytes());
        out.extend_from_slice(&meta);
        let tensors: Vec<&Vec<f32>> = self
            .params
            .iter()
            .chain(&self.opt_m)
            .chain(&self.opt_v)
            .collect();
        out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        for t in tensors {
            out.extend_from_slice(&(t.len() as u64).to_le_bytes());
            for x in t {
                out.extend_from_slice(&x.to_bits().to_le_bytes());
            }
        }
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        fnv(&mut h, &out);
        out.extend_from_slice(&h.to_le_bytes());
        out
    }

    /// Parses bytes written by [`Checkpoint::to_bytes`].
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Checkpoint, CheckpointError> {
        let bad = |reason: &str| CheckpointError::Corrupt {
            path: path.to_path_buf(),
            reason: reason.to_string(),
        };
        if bytes.len() < 8 + 4 + 8 + 8 + 8 || &bytes[..8] != MAGIC {
            return Err(bad("bad magic or too short"));
        }
        let (body, sum) = bytes.split_at(bytes.len() - 8);
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        fnv(&mut h, body);
        if sum != h.to_le_bytes() {
            return Err(bad("checksum mismatch (torn or modified file)"));
        }
        let mut pos = 8;
        let mut take = |n: usize| -> Result<&[u8], CheckpointError> {
            if body.len() - pos < n {
                return Err(bad("truncated"));
            }
            let s = &body[pos..pos + n];
            pos += n;
            Ok(s)
        };
        let u64_of = |s: &[u8]| {
            let mut a = [0u8; 8];
            a.copy_from_slice(s);
            u64::from_le_bytes(a)
        };
        let ver = take(4)?;
        if ver != VERSION.to_le_bytes() {
            return Err(bad("unsupported format version"));
        }
        let mlen = u64_of(take(8)?) as usize;
        let meta: Meta =
            serde_json::from_slice(take(mlen)?).map_err(|e| bad(&format!("metadata: {e}")))?;
        let nt = u64_of(take(8)?) as usize;
        let mut tensors = Vec::new();
        for _ in 0..nt {
            let n = u64_of(take(8)?) as usize;
            let raw = take(
                n.checked_mul(4)
                    .ok_or_else(|| bad("tensor length overflow"))?,
            )?;
            tensors.push(
                raw.chunks_exact(4)
                    .map(|c| f32::from_bits(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                    .collect::<Vec<f32>>(),
            );
        }
        let np = meta.param_sizes.len();
        let nv = match meta.optimizer {
            OptimizerKind::Sgd { .. } => 0,
            OptimizerKind::AdamW { .. } => np,
        };
        if tensors.len() != 2 * np + nv {
            return Err(bad("tensor count does not match the metadata"));
        }
        let opt_v = tensors.split_off(2 * np);
        let opt_m = tensors.split_off(np);
        let params = tensors;
        for group in [&params, &opt_m] {
            if group
                .iter()
                .zip(&meta.param_sizes)
                .any(|(t, &s)| t.len() != s)
            {
                return Err(bad("tensor sizes do not match the metadata"));
            }
        }
        Ok(Checkpoint {
            meta,
            params,
            opt_m,
            opt_v,
        })
    }

    /// Writes to `dir/ckpt-<step>.weft` atomically; keeps the newest `keep` checkpoints.
    pub fn save(&self, dir: &Path, keep: usize) -> Result<PathBuf, CheckpointError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| CheckpointError::Io { path, source }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let final_path = dir.join(file_name(self.meta.step));
        let tmp = dir.join(format!(
            ".{}.tmp-{}",
            file_name(self.meta.step),
            std::process::id()
        ));
        {
            let mut f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
            f.write_all(&self.to_bytes()).map_err(io(&tmp))?;
            f.sync_all().map_err(io(&tmp))?;
        }
        std::fs::rename(&tmp, &final_path).map_err(io(&final_path))?;
        if let Ok(d) = std::fs::File::open(dir) {
            // Makes the rename durable; not all file systems support fsync on directories.
            let _ = d.sync_all();
        }
        // Temporary files of writers that died before their rename.
        if let Ok(rd) = std::fs::read_dir(dir) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().to_string();
                if name.starts_with(".ckpt-") && name.contains(".weft.tmp-") {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        let mut all = list(dir)?;
        while all.len() > keep.max(1) {
            let (_, p) = all.remove(0);
            let _ = std::fs::remove_file(p);
        }
        Ok(final_path)
    }

    /// Reads a checkpoint file.
    pub fn load(path: &Path) -> Result<Checkpoint, CheckpointError> {
        let bytes = std::fs::read(path).map_err(|source| CheckpointError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Checkpoint::from_bytes(&bytes, path)
    }
}

/// Checkpoints in `dir`, oldest first, as (step, path).
pub fn list(dir: &Path) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(CheckpointError::Io {
                path: dir.to_path_buf(),
                source,
            })
        }
    };
    let mut out = Vec::new();
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if let Some(step) = name
            .strip_prefix("ckpt-")
            .and_then(|s| s.strip_suffix(".weft"))
            .and_then(|s| s.parse::<u64>().ok())
        {
            out.push((step, e.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// The newest checkpoint in `dir` that loads (older ones are tried if the newest is corrupt).
pub fn newest(dir: &Path) -> Result<Option<Checkpoint>, CheckpointError> {
    for (_, p) in list(dir)?.into_iter().rev() {
        if let Ok(c) = Checkpoint::load(&p) {
            return Ok(Some(c));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(step: u64) -> Checkpoint {
        Checkpoint {
            meta: Meta {
                step,
                epoch: 2,
                step_in_epoch: 3,
                seed: 5,
                param_sizes: vec![3, 1],
                optimizer: OptimizerKind::adamw(),
                optimizer_t: step,
                rng: Rng::new(1, 2),
                bucket_order: Some(vec![1, 0]),
                world_size: 2,
            },
            params: vec![vec![1.0, f32::MIN_POSITIVE, -0.0], vec![f32::NAN]],
            opt_m: vec![vec![0.5; 3], vec![2.0]],
            opt_v: vec![vec![0.25; 3], vec![4.0]],
        }
    }

    #[test]
    fn round_trip_atomic_keep_and_corruption() {
        let dir = std::env::temp_dir().join(format!("weft-ckpt-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let stale = dir.join(".ckpt-0000000005.weft.tmp-1");
        std::fs::write(&stale, b"torn").unwrap();
        for s in [10, 20, 30] {
            sample(s).save(&dir, 2).unwrap();
        }
        let l = list(&dir).unwrap();
        assert_eq!(l.iter().map(|x| x.0).collect::<Vec<_>>(), vec![20, 30]);
        assert!(!stale.exists(), "stale temporary file removed");
        let c = newest(&dir).unwrap().unwrap();
        assert_eq!(c.meta, sample(30).meta);
        assert_eq!(c.to_bytes(), sample(30).to_bytes());
        // corrupt the newest: the older one is used
        let mut b = std::fs::read(&l[1].1).unwrap();
        let k = b.len() / 2;
        b[k] ^= 1;
        std::fs::write(&l[1].1, &b).unwrap();
        assert!(matches!(
            Checkpoint::load(&l[1].1),
            Err(CheckpointError::Corrupt { .. })
        ));
        assert_eq!(newest(&dir).unwrap().unwrap().meta.step, 20);
        std::fs::write(&l[0].1, b"WEFTCKPT").unwrap();
        assert!(newest(&dir).unwrap().is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
