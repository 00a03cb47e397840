//! Optimizers: SGD with momentum (PyTorch's formulation) and AdamW, plus linear warm-up.

use serde::{Deserialize, Serialize};

/// Which optimizer and its hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum OptimizerKind {
    /// `buf = momentum·buf + (g + wd·p)`; `p -= lr·buf`.
    Sgd { momentum: f32, weight_decay: f32 },
    /// Adam with decoupled weight decay: `p -= lr·wd·p`, then the Adam update.
    AdamW {
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
    },
}

impl OptimizerKind {
    pub fn sgd() -> Self {
        OptimizerKind::Sgd {
            momentum: 0.9,
            weight_decay: 0.0,
        }
    }

    pub fn adamw() -> Self {
        OptimizerKind::AdamW {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// Learning rate at optimizer step `step` (0-based): linear warm-up over `warmup` steps.
pub fn warmup_lr(base: f32, step: u64, warmup: u64) -> f32 {
    if warmup == 0 || step >= warmup {
        base
    } else {
        base * (step + 1) as f32 / warmup as f32
    }
}

/// Optimizer state: one or two buffers per parameter and the step count.
#[derive(Debug, Clone, PartialEq)]
pub struct Optimizer {
    pub kind: OptimizerKind,
    /// Momentum buffers (SGD) or first moments (AdamW).
    pub m: Vec<Vec<f32>>,
    /// Second moments (AdamW; empty for SGD).
    pub v: Vec<Vec<f32>>,
    /// Steps taken.
    pub t: u64,
}

impl Optimizer {
    pub fn new(kind: OptimizerKind, sizes: &[usize]) -> Self {
        let zeros = || sizes.iter().map(|&n| vec![0.0f32; n]).collect::<Vec<_>>();
        let v = match kind {
            OptimizerKind::Sgd { .. } => Vec::new(),
            OptimizerKind::AdamW { .. } => zeros(),
        };
        Optimizer {
            kind,
            m: zeros(),
            v,
            t: 0,
        }
    }

    /// Updates parameter `i` with gradient `g` (call for every parameter, then [`Self::tick`]).
    pub fn update(&mut self, i: usize, p: &mut [f32], g: &[f32], lr: f32) {
        match self.kind {
            OptimizerKind::Sgd {
                momentum,
                weight_decay,
            } => {
                let first = self.t == 0;
                for ((p, &g), b) in p.iter_mut().zip(g).zip(self.m[i].iter_mut()) {
                    let d = g + weight_decay * *p;
                    *b = if first { d } else { momentum * *b + d };
                    *p -= lr * *b;
                }
            }
            OptimizerKind::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
            } => {
                let t = (self.t + 1) as i32;
                let bc1 = 1.0 - beta1.powi(t);
                let bc2 = 1.0 - beta2.powi(t);
                let (m, v) = (&mut self.m[i], &mut self.v[i]);
                for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                    *p -= lr * weight_decay * *p;
                    *m = beta1 * *m + (1.0 - beta1) * g;
                    *v = beta2 * *v + (1.0 - beta2) * g * g;
                    let mh = *m / bc1;
                    let vh = *v / bc2;
                    *p -= lr * mh / (vh.sqrt() + eps);
                }
            }
        }
    }

    /// Ends a step.
    pub fn tick(&mut self) {
        self.t += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sgd_and_adamw_descend_a_quadratic() {
        for kind in [OptimizerKind::sgd(), OptimizerKind::adamw()] {
            let mut p = vec![3.0f32, -2.0];
            let mut o = Optimizer::new(kind, &[2]);
            for s in 0..300 {
                let g: Vec<f32> = p.iter().map(|x| 2.0 * x).collect();
                o.update(0, &mut p, &g, warmup_lr(0.05, s, 10));
                o.tick();
            }
            assert!(p.iter().all(|x| x.abs() < 0.05), "{kind:?}: {p:?}");
        }
        assert_eq!(warmup_lr(1.0, 0, 4), 0.25);
        assert_eq!(warmup_lr(1.0, 3, 4), 1.0);
        assert_eq!(warmup_lr(1.0, 9, 4), 1.0);
    }
}
