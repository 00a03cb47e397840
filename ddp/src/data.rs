//! Data: a deterministic synthetic classification set, an MNIST-format (IDX) loader, and the
//! distributed sampler.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::rng::Rng;

/// Errors reading data files.
#[derive(Debug, Error)]
pub enum DataError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not an IDX file of the expected kind: {reason}")]
    Format { path: PathBuf, reason: String },
    #[error("no {what} file in {dir} (tried {tried})")]
    Missing {
        dir: PathBuf,
        what: &'static str,
        tried: String,
    },
}

/// Rows of features with a class label each.
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    /// `len() * dim` features, row-major.
    pub x: Vec<f32>,
    pub y: Vec<u32>,
    pub dim: usize,
    pub classes: usize,
}

impl Dataset {
    pub fn len(&self) -> usize {
        self.y.len()
    }

    pub fn is_empty(&self) -> bool {
        self.y.is_empty()
    }

    /// Copies the rows `idx` into `x` and `y` (cleared first).
    pub fn gather(&self, idx: &[usize], x: &mut Vec<f32>, y: &mut Vec<u32>) {
        x.clear();
        y.clear();
        for &i in idx {
            x.extend_from_slice(&self.x[i * self.dim..(i + 1) * self.dim]);
            y.push(self.y[i]);
        }
    }
}

/// The synthetic set: `classes` Gaussian clusters in `dim` dimensions whose centres are drawn
/// from `seed` (the same for the training and test split), unit noise. Learnable by a linear
/// model to ≈ 90 % and by an MLP further; chance is 1/classes.
pub fn synthetic(n: usize, dim: usize, classes: usize, seed: u64, split: u64) -> Dataset {
    let n = if classes == 0 { 0 } else { n };
    let mut crng = Rng::new(seed, 0x5eed);
    let sep = 0.6;
    let centres: Vec<f64> = (0..classes * dim).map(|_| crng.normal() * sep).collect();
    let mut rng = Rng::new(seed, 0x1000 + split);
    let mut x = Vec::with_capacity(n * dim);
    let mut y = Vec::with_capacity(n);
    for _ in 0..n {
        let c = rng.below(classes as u64) as usize;
        y.push(c as u32);
        for j in 0..dim {
            x.push((centres[c * dim + j] + rng.normal()) as f32);
        }
    }
    Dataset { x, y, dim, classes }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Reads an IDX file of unsigned bytes: (dimensions, data).
pub fn read_idx_u8(path: &Path) -> Result<(Vec<usize>, Vec<u8>), DataError> {
    let mut f = std::fs::File::open(path).map_err(io_err(path))?;
    let mut bytes = Vec::new();
    f.read_to_end(&mut bytes).map_err(io_err(path))?;
    let fmt = |reason: String| DataError::Format {
        path: path.to_path_buf(),
        reason,
    };
    if bytes.len() < 4 || bytes[0] != 0 || bytes[1] != 0 {
        return Err(fmt("bad magic number".into()));
    }
    if bytes[2] != 0x08 {
        return Err(fmt(format!(
            "element type 0x{:02x}, only unsigned bytes (0x08) are supported",
            bytes[2]
        )));
    }
    let nd = bytes[3] as usize;
    if nd == 0 || bytes.len() < 4 + 4 * nd {
        return Err(fmt("truncated header".into()));
    }
    let dims: Vec<usize> = (0..nd)
        .map(|i| {
            let o = 4 + 4 * i;
            u32::from_be_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]]) as usize
        })
        .collect();
    let count = dims
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| fmt("dimensions overflow".into()))?;
    let body = &bytes[4 + 4 * nd..];
    if body.len() != count {
        return Err(fmt(format!(
            "header says {count} elements, file has {}",
            body.len()
        )));
    }
    Ok((dims, body.to_vec()))
}

/// Writes an IDX file of unsigned bytes (used by tests and to make small data sets).
pub fn write_idx_u8(path: &Path, dims: &[usize], data: &[u8]) -> std::io::Result<()> {
    let mut f = std::fs::File::create(path)?;
    f.write_all(&[0, 0, 0x08, dims.len() as u8])?;
    for &d in dims {
        f.write_all(&(d as u32).to_be_bytes())?;
    }
    f.write_all(data)?;
    f.sync_all()
}

/// Loads an images file (n × rows × cols, scaled to [0, 1]) and a labels file (n).
pub fn load_idx_pair(images: &Path, labels: &Path) -> Result<Dataset, DataError> {
    let (idims, ibytes) = read_idx_u8(images)?;
    let (ldims, lbytes) = read_idx_u8(labels)?;
    if idims.len() < 2 {
        return Err(DataError::Format {
            path: images.to_path_buf(),
            reason: "images need at least 2 dimensions".into(),
        });
    }
    if ldims.len() != 1 || ldims[0] != idims[0] {
        return Err(DataError::Format {
            path: labels.to_path_buf(),
            reason: format!("labels {ldims:?} do not match {} images", idims[0]),
        });
    }
    let dim: usize = idims[1..].iter().product();
    let x = ibytes.iter().map(|&b| b as f32 / 255.0).collect();
    let y: Vec<u32> = lbytes.iter().map(|&b| b as u32).collect();
    let classes = y.iter().max().map_or(1, |&m| m as usize + 1).max(10);
    Ok(Dataset { x, y, dim, classes })
}

fn find(dir: &Path, what: &'static str, names: &[&str]) -> Result<PathBuf, DataError> {
    for n in names {
        let p = dir.join(n);
        if p.is_file() {
            return Ok(p);
        }
    }
    Err(DataError::Missing {
        dir: dir.to_path_buf(),
        what,
        tried: names.join(", "),
    })
}

/// Loads MNIST-format files from `dir`: `train-images-idx3-ubyte` / `train-labels-idx1-ubyte`
/// (also with `.idx3-ubyte` spelling), and the `t10k-*` test pair if present.
pub fn load_idx_dir(dir: &Path) -> Result<(Dataset, Option<Dataset>), DataError> {
    let ti = find(
        dir,
        "training images",
        &["train-images-idx3-ubyte", "train-images.idx3-ubyte"],
    )?;
    let tl = find(
        dir,
        "training labels",
        &["train-labels-idx1-ubyte", "train-labels.idx1-ubyte"],
    )?;
    let mut train = load_idx_pair(&ti, &tl)?;
    let test = match (
        find(
            dir,
            "test images",
            &["t10k-images-idx3-ubyte", "t10k-images.idx3-ubyte"],
        ),
        find(
            dir,
            "test labels",
            &["t10k-labels-idx1-ubyte", "t10k-labels.idx1-ubyte"],
        ),
    ) {
        (Ok(i), Ok(l)) => Some(load_idx_pair(&i, &l)?),
        _ => None,
    };
    if let Some(t) = &test {
        if t.dim != train.dim {
            return Err(DataError::Format {
                path: dir.to_path_buf(),
                reason: format!(
                    "test rows have {} features, training rows {}",
                    t.dim, train.dim
                ),
            });
        }
        train.classes = train.classes.max(t.classes);
    }
    let classes = train.classes;
    Ok((train, test.map(|t| Dataset { classes, ..t })))
}

/// The distributed sampler. Every epoch the indices are shuffled from (`seed`, epoch); each
/// optimizer step takes the next `global = per_rank_batch × accum × world` of them, and rank
/// `r`'s micro-batch `j` is the block `(j × world + r) × per_rank_batch` of that step, so the
/// ranks' shards are disjoint and together are exactly what one process training on the
/// global batch would see. The tail that does not fill a step is dropped.
#[derive(Debug, Clone)]
pub struct DistributedSampler {
    pub len: usize,
    pub world: usize,
    pub rank: usize,
    pub per_rank_batch: usize,
    pub accum: usize,
    pub seed: u64,
    epoch: Option<u64>,
    perm: Vec<usize>,
}

impl DistributedSampler {
    pub fn new(
        len: usize,
        world: usize,
        rank: usize,
        per_rank_batch: usize,
        accum: usize,
        seed: u64,
    ) -> Self {
        DistributedSampler {
            len,
            world,
            rank,
            per_rank_batch,
            accum,
            seed,
            epoch: None,
            perm: Vec::new(),
        }
    }

    /// Samples per optimizer step over all ranks.
    pub fn global_batch(&self) -> usize {
        self.per_rank_batch * self.accum * self.world
    }

    /// Optimizer steps per epoch.
    pub fn steps_per_epoch(&self) -> usize {
        self.len / self.global_batch().max(1)
    }

    /// Reshuffles for `epoch`.
    pub fn set_epoch(&mut self, epoch: u64) {
        if self.epoch == Some(epoch) {
            return;
        }
        self.perm = (0..self.len).collect();
        Rng::new(self.seed, 0xe90c_0000 + epoch).shuffle(&mut self.perm);
        self.epoch = Some(epoch);
    }

    /// This rank's indices for micro-batch `micro` of step `step` of the current epoch; `None`
    /// past the end of the epoch or before [`Self::set_epoch`].
    pub fn micro_batch(&self, step: usize, micro: usize) -> Option<&[usize]> {
        if step >= self.steps_per_epoch() {
            return None;
        }
        self.micro_batch_at(step * self.global_batch(), micro)
    }

    /// This rank's indices for micro-batch `micro` of the step that starts `offset` samples into
    /// the current epoch's order; `None` when that step does not fit in the epoch. An elastic
    /// run whose world size changed mid-epoch continues from the samples its steps so far used:
    /// the survivors (or the grown set) share the rest of the epoch's order among themselves.
    pub fn micro_batch_at(&self, offset: usize, micro: usize) -> Option<&[usize]> {
        if !self.step_fits(offset) || micro >= self.accum || self.rank >= self.world {
            return None;
        }
        let start = offset + (micro * self.world + self.rank) * self.per_rank_batch;
        self.perm.get(start..start + self.per_rank_batch)
    }

    /// Whether a whole global batch starting `offset` samples into the epoch fits in it.
    pub fn step_fits(&self, offset: usize) -> bool {
        offset
            .checked_add(self.global_batch())
            .is_some_and(|end| end <= self.len && self.global_batch() > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_disjoint_and_cover_the_global_batch() {
        let world = 3;
        let mut all = Vec::new();
        for r in 0..world {
            let mut s = DistributedSampler::new(100, world, r, 4, 2, 9);
            s.set_epoch(1);
            assert_eq!(s.steps_per_epoch(), 4);
            for step in 0..s.steps_per_epoch() {
                for m in 0..2 {
                    all.extend_from_slice(s.micro_batch(step, m).unwrap());
                }
            }
        }
        let mut single = DistributedSampler::new(100, 1, 0, 12, 2, 9);
        single.set_epoch(1);
        let mut want = Vec::new();
        for st in 0..4 {
            for m in 0..2 {
                want.extend_from_slice(single.micro_batch(st, m).unwrap());
            }
        }
        all.sort();
        want.sort();
        assert_eq!(all, want);
        let mut d = all.clone();
        d.dedup();
        assert_eq!(d.len(), all.len());
        let mut e2 = single.clone();
        e2.set_epoch(2);
        assert_ne!(e2.micro_batch(0, 0), single.micro_batch(0, 0));
        assert!(e2.micro_batch(4, 0).is_none());
        assert!(e2.micro_batch(0, 2).is_none());
        assert!(DistributedSampler::new(10, 1, 0, 2, 1, 0)
            .micro_batch(0, 0)
            .is_none());
    }

    #[test]
    fn survivors_share_the_rest_of_the_epoch() {
        // 4 ranks take 2 steps of 4 × 3 samples, then 3 ranks the rest from offset 24.
        let (len, batch) = (60, 3);
        let mut seen = Vec::new();
        for r in 0..4 {
            let mut s = DistributedSampler::new(len, 4, r, batch, 1, 5);
            s.set_epoch(0);
            for step in 0..2 {
                seen.extend_from_slice(s.micro_batch(step, 0).unwrap());
            }
        }
        let mut offset = 24;
        let three: Vec<DistributedSampler> = (0..3)
            .map(|r| {
                let mut s = DistributedSampler::new(len, 3, r, batch, 1, 5);
                s.set_epoch(0);
                s
            })
            .collect();
        while three[0].step_fits(offset) {
            for s in &three {
                seen.extend_from_slice(s.micro_batch_at(offset, 0).unwrap());
            }
            offset += three[0].global_batch();
        }
        assert_eq!(offset, 60);
        assert!(three[1].micro_batch_at(offset, 0).is_none());
        seen.sort();
        assert_eq!(seen, (0..len).collect::<Vec<_>>());
    }

    #[test]
    fn idx_round_trip_and_errors() {
        let dir = std::env::temp_dir().join(format!("weft-idx-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let imgs: Vec<u8> = (0..3 * 2 * 2).map(|i| i as u8 * 20).collect();
        write_idx_u8(&dir.join("train-images-idx3-ubyte"), &[3, 2, 2], &imgs).unwrap();
        write_idx_u8(&dir.join("train-labels-idx1-ubyte"), &[3], &[1, 0, 9]).unwrap();
        let (train, test) = load_idx_dir(&dir).unwrap();
        assert!(test.is_none());
        assert_eq!(train.dim, 4);
        assert_eq!(train.y, vec![1, 0, 9]);
        assert_eq!(train.classes, 10);
        assert_eq!(train.x[1], 20.0 / 255.0);
        std::fs::write(
            dir.join("train-labels-idx1-ubyte"),
            [0u8, 0, 8, 1, 0, 0, 0, 5, 1],
        )
        .unwrap();
        assert!(matches!(load_idx_dir(&dir), Err(DataError::Format { .. })));
        std::fs::write(dir.join("train-labels-idx1-ubyte"), [7u8]).unwrap();
        assert!(matches!(load_idx_dir(&dir), Err(DataError::Format { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(matches!(load_idx_dir(&dir), Err(DataError::Missing { .. })));
    }
}
