//! A multilayer perceptron with its own forward and backward pass, layer by layer, whose
//! gradients go straight into the reducer's buckets: the last layer's gradients are ready
//! first, and their buckets communicate while earlier layers still compute.
//!
//! Matrix products go through `ndarray` (`general_mat_mul`, backed by `matrixmultiply`).

use ndarray::linalg::general_mat_mul;
use ndarray::{Array2, ArrayView2, ArrayViewMut2, Axis};

use crate::reducer::{Reducer, ReducerError};
use crate::rng::Rng;

/// Shape of the network: `input → hidden[0] → … → classes`, ReLU between linear layers,
/// softmax cross-entropy at the end. `unused_param` adds one registered parameter that never
/// receives a gradient (to exercise the reducer's unused-parameter handling).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MlpShape {
    pub input: usize,
    pub hidden: Vec<usize>,
    pub classes: usize,
    pub unused_param: bool,
}

impl MlpShape {
    /// Layer widths including input and output.
    pub fn dims(&self) -> Vec<usize> {
        let mut d = vec![self.input];
        d.extend(&self.hidden);
        d.push(self.classes);
        d
    }

    /// Number of linear layers.
    pub fn layers(&self) -> usize {
        self.hidden.len() + 1
    }

    /// Element counts of the parameters in registration order: W0, b0, W1, b1, …, `[unused]`.
    pub fn param_sizes(&self) -> Vec<usize> {
        let d = self.dims();
        let mut s = Vec::new();
        for l in 0..self.layers() {
            s.push(d[l + 1] * d[l]);
            s.push(d[l + 1]);
        }
        if self.unused_param {
            s.push(17);
        }
        s
    }

    /// Initial parameters: He-normal weights, zero biases.
    pub fn init(&self, rng: &mut Rng) -> Vec<Vec<f32>> {
        let d = self.dims();
        let mut out = Vec::new();
        for l in 0..self.layers() {
            let std = (2.0 / d[l] as f64).sqrt();
            out.push(
                (0..d[l + 1] * d[l])
                    .map(|_| (rng.normal() * std) as f32)
                    .collect(),
            );
            out.push(vec![0.0; d[l + 1]]);
        }
        if self.unused_param {
            out.push((0..17).map(|_| rng.normal() as f32).collect());
        }
        out
    }
}

/// Loss and number of correct predictions of one batch.
#[derive(Debug, Clone, Copy, Default)]
pub struct BatchResult {
    /// Mean cross-entropy over the batch.
    pub loss: f64,
    pub correct: usize,
    pub count: usize,
}

fn shape_err(e: ndarray::ShapeError) -> ReducerError {
    ReducerError::InvalidArgument(format!("tensor shape: {e}"))
}

/// Checks that a batch and the parameters fit the shape (user data must not cause a panic).
fn check_inputs(
    shape: &MlpShape,
    params: &[Vec<f32>],
    x: &[f32],
    labels: &[u32],
) -> Result<(), ReducerError> {
    let bad = |m: String| Err(ReducerError::InvalidArgument(m));
    if params.len() < 2 * shape.layers() {
        return bad(format!(
            "{} parameter tensors for a {}-layer network",
            params.len(),
            shape.layers()
        ));
    }
    if Some(x.len()) != labels.len().checked_mul(shape.input) {
        return bad(format!(
            "{} features for {} samples of {}",
            x.len(),
            labels.len(),
            shape.input
        ));
    }
    if let Some(&y) = labels.iter().find(|&&y| y as usize >= shape.classes) {
        return bad(format!("label {y} with {} classes", shape.classes));
    }
    Ok(())
}

/// Forward pass; returns the activations of every layer (input first, logits last).
pub fn forward(
    shape: &MlpShape,
    params: &[Vec<f32>],
    x: &[f32],
    batch: usize,
) -> Result<Vec<Array2<f32>>, ReducerError> {
    if params.len() < 2 * shape.layers() {
        return Err(ReducerError::InvalidArgument(format!(
            "{} parameter tensors for a {}-layer network",
            params.len(),
            shape.layers()
        )));
    }
    let d = shape.dims();
    let mut acts = Vec::with_capacity(d.len());
    acts.push(
        ArrayView2::from_shape((batch, d[0]), x)
            .map_err(shape_err)?
            .to_owned(),
    );
    for l in 0..shape.layers() {
        let w = ArrayView2::from_shape((d[l + 1], d[l]), &params[2 * l][..]).map_err(shape_err)?;
        let b = &params[2 * l + 1];
        let mut z = Array2::<f32>::zeros((batch, d[l + 1]));
        for mut row in z.rows_mut() {
            row.iter_mut().zip(b).for_each(|(z, &b)| *z = b);
        }
        general_mat_mul(1.0, &acts[l], &w.t(), 1.0, &mut z);
        if l + 1 < shape.layers() {
            z.mapv_inplace(|v| v.max(0.0));
        }
        acts.push(z);
    }
    Ok(acts)
}

/// Softmax cross-entropy of `logits` against `labels`: (mean loss, correct, dlogits of the
/// mean loss times `scale`).
pub fn loss_and_grad(
    logits: &Array2<f32>,
    labels: &[u32],
    scale: f32,
) -> Result<(BatchResult, Array2<f32>), ReducerError> {
    let batch = logits.nrows();
    if labels.len() != batch || labels.iter().any(|&y| y as usize >= logits.ncols()) {
        return Err(ReducerError::InvalidArgument(format!(
            "{} labels (each < {}) for {batch} rows of logits",
            labels.len(),
            logits.ncols()
        )));
    }
    let mut g = logits.clone();
    let mut loss = 0.0f64;
    let mut correct = 0;
    for (i, mut row) in g.rows_mut().into_iter().enumerate() {
        let y = labels[i] as usize;
        let (mut arg, mut m) = (0, f32::NEG_INFINITY);
        for (j, &v) in row.iter().enumerate() {
            if v > m {
                m = v;
                arg = j;
            }
        }
        if arg == y {
            correct += 1;
        }
        let mut sum = 0.0f32;
        row.mapv_inplace(|v| {
            let e = (v - m).exp();
            sum += e;
            e
        });
        let py = row[y] / sum;
        loss -= (py.max(1e-30) as f64).ln();
        let k = scale / batch as f32;
        row.mapv_inplace(|e| e / sum * k);
        row[y] -= k;
    }
    Ok((
        BatchResult {
            loss: loss / batch.max(1) as f64,
            correct,
            count: batch,
        },
        g,
    ))
}

/// Forward and backward pass of one batch. Gradients are *added* to the reducer's gradient
/// memory (so micro-batches accumulate) and each parameter is marked ready as soon as its
/// gradient is complete, last layer first. `scale` multiplies the mean loss (1/k for k
/// accumulated micro-batches).
pub fn forward_backward(
    shape: &MlpShape,
    params: &[Vec<f32>],
    x: &[f32],
    labels: &[u32],
    scale: f32,
    reducer: &mut Reducer<'_>,
) -> Result<BatchResult, ReducerError> {
    check_inputs(shape, params, x, labels)?;
    let batch = labels.len();
    let d = shape.dims();
    let acts = forward(shape, params, x, batch)?;
    let (res, mut dz) = loss_and_grad(&acts[shape.layers()], labels, scale)?;
    for l in (0..shape.layers()).rev() {
        let (pw, pb) = (2 * l, 2 * l + 1);
        {
            let gb = reducer.grad_mut(pb)?;
            for (g, s) in gb.iter_mut().zip(dz.sum_axis(Axis(0))) {
                *g += s;
            }
        }
        reducer.grad_ready(pb)?;
        {
            let gw = reducer.grad_mut(pw)?;
            let mut gw = ArrayViewMut2::from_shape((d[l + 1], d[l]), gw).map_err(shape_err)?;
            general_mat_mul(1.0, &dz.t(), &acts[l], 1.0, &mut gw);
        }
        reducer.grad_ready(pw)?;
        if l > 0 {
            let w = ArrayView2::from_shape((d[l + 1], d[l]), &params[pw][..]).map_err(shape_err)?;
            let mut dh = Array2::<f32>::zeros((batch, d[l]));
            general_mat_mul(1.0, &dz, &w, 0.0, &mut dh);
            dh.zip_mut_with(&acts[l], |g, &a| {
                if a <= 0.0 {
                    *g = 0.0
                }
            });
            dz = dh;
        }
    }
    Ok(res)
}

/// Loss and accuracy of `params` on a data set, in batches of `batch`.
pub fn evaluate(
    shape: &MlpShape,
    params: &[Vec<f32>],
    x: &[f32],
    labels: &[u32],
    batch: usize,
) -> Result<BatchResult, ReducerError> {
    check_inputs(shape, params, x, labels)?;
    let mut total = BatchResult::default();
    let d = shape.input;
    let batch = batch.max(1);
    let mut i = 0;
    while i < labels.len() {
        let n = batch.min(labels.len() - i);
        let acts = forward(shape, params, &x[i * d..(i + n) * d], n)?;
        let (r, _) = loss_and_grad(&acts[shape.layers()], &labels[i..i + n], 1.0)?;
        total.loss += r.loss * n as f64;
        total.correct += r.correct;
        total.count += n;
        i += n;
    }
    if total.count > 0 {
        total.loss /= total.count as f64;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reducer::ReducerConfig;
    use weftcc_comm::{Communicator, UniqueId};

    fn one_rank() -> Communicator {
        let id = UniqueId::new().unwrap();
        Communicator::init(0, 1, &id).unwrap()
    }

    /// Backward agrees with finite differences of the forward loss.
    #[test]
    fn gradients_match_finite_differences() {
        let shape = MlpShape {
            input: 5,
            hidden: vec![7, 6],
            classes: 3,
            unused_param: false,
        };
        let mut rng = Rng::new(4, 0);
        let params = shape.init(&mut rng);
        let batch = 4;
        let x: Vec<f32> = (0..batch * 5).map(|_| rng.normal() as f32).collect();
        let y = vec![0u32, 2, 1, 2];
        let comm = one_rank();
        let mut red = Reducer::new(&comm, &shape.param_sizes(), ReducerConfig::default()).unwrap();
        red.zero_grad().unwrap();
        red.prepare_for_backward(true).unwrap();
        forward_backward(&shape, &params, &x, &y, 1.0, &mut red).unwrap();
        red.finish().unwrap();
        let loss = |p: &[Vec<f32>]| evaluate(&shape, p, &x, &y, batch).unwrap().loss;
        for (pi, tensor) in params.iter().enumerate() {
            for k in [0, tensor.len() / 2, tensor.len() - 1] {
                let h = 1e-2f32;
                let mut plus = params.clone();
                plus[pi][k] += h;
                let mut minus = params.clone();
                minus[pi][k] -= h;
                let numeric = (loss(&plus) - loss(&minus)) / (2.0 * h as f64);
                let analytic = red.grad(pi).unwrap()[k] as f64;
                assert!(
                    (numeric - analytic).abs() <= 2e-3 + 2e-2 * analytic.abs(),
                    "param {pi}[{k}]: numeric {numeric} analytic {analytic}"
                );
            }
        }
    }

    #[test]
    fn bad_inputs_are_errors() {
        let shape = MlpShape {
            input: 2,
            hidden: vec![3],
            classes: 2,
            unused_param: false,
        };
        let params = shape.init(&mut Rng::new(1, 1));
        assert!(evaluate(&shape, &params, &[0.0; 4], &[0, 2], 8).is_err());
        assert!(evaluate(&shape, &params, &[0.0; 3], &[0, 1], 8).is_err());
        assert!(evaluate(&shape, &params[..1], &[0.0; 4], &[0, 1], 8).is_err());
        assert!(forward(&shape, &params[..1], &[0.0; 4], 2).is_err());
        assert!(evaluate(&shape, &params, &[0.0; 4], &[0, 1], 0).is_ok());
        let logits = Array2::<f32>::zeros((2, 2));
        assert!(loss_and_grad(&logits, &[0], 1.0).is_err());
    }
}
