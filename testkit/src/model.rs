//! Exhaustive interleaving exploration for the concurrency protocols (the shared-memory ring,
//! its doorbells and the dial rule in `weftcc-transports`, the communicator's ticket protocol in
//! `weftcc-comm`): a protocol is written as a [`Model`], a state machine whose threads each take
//! one atomic step at a time, and [`explore`] visits every state any interleaving reaches,
//! checking an invariant in each and that no reachable state leaves unfinished threads with
//! nothing to do (a lost wake-up).
//!
//! Steps are sequentially consistent. That is exact for what the models check: the wake-up
//! handshakes use `SeqCst` on both sides, and the counters they guard are single-writer and
//! monotonic, published with Release and read with Acquire after the handshake, so a stale read
//! can only under-state progress and is followed by another look once the doorbell rings.
//! (loom would treat the `SeqCst` store-buffering pattern as acquire/release and report wake-ups
//! lost that cannot be lost; see tokio-rs/loom#180.)

use std::collections::HashSet;
use std::fmt::Debug;
use std::hash::Hash;

/// A protocol as a state machine.
pub trait Model: Clone + Eq + Hash + Debug {
    /// How many threads take steps.
    fn threads(&self) -> usize;
    /// The states thread `t`'s next atomic step can lead to (several where the thread chooses,
    /// e.g. how many bytes a reader takes); none when it is blocked or finished.
    fn steps(&self, t: usize) -> Vec<Self>;
    /// Whether every thread has finished its work.
    fn finished(&self) -> bool;
    /// The invariant every reachable state keeps.
    fn check(&self) -> Result<(), &'static str>;
}

/// What a whole exploration saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Explored {
    /// Distinct states reached.
    pub states: usize,
    /// Of them, states in which every thread had finished.
    pub finished: usize,
}

/// A reachable state that breaks the protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation<M> {
    /// The invariant does not hold.
    Invariant { state: M, why: &'static str },
    /// No thread can move, and not all have finished: somebody waits for a wake-up that will
    /// not come.
    Stuck { state: M },
    /// More than the allowed number of states: the model is too large to explore.
    TooLarge { states: usize },
}

impl<M: Debug> std::fmt::Display for Violation<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Violation::Invariant { state, why } => write!(f, "{why}: {state:#?}"),
            Violation::Stuck { state } => write!(f, "stuck (a lost wake-up): {state:#?}"),
            Violation::TooLarge { states } => write!(f, "model too large: {states} states"),
        }
    }
}

/// `model` with a fault injected into every step (`fault(before, thread, after)` may change the
/// state a step of `thread` reached): how a test shows that the exploration does find a broken
/// protocol.
#[derive(Clone, Debug)]
pub struct Faulty<M> {
    pub model: M,
    pub fault: fn(&M, usize, &mut M),
}

// States compare by the model alone: one exploration has one fault.
impl<M: PartialEq> PartialEq for Faulty<M> {
    fn eq(&self, other: &Self) -> bool {
        self.model == other.model
    }
}

impl<M: Eq> Eq for Faulty<M> {}

impl<M: Hash> Hash for Faulty<M> {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.model.hash(state);
    }
}

impl<M: Model> Model for Faulty<M> {
    fn threads(&self) -> usize {
        self.model.threads()
    }

    fn steps(&self, t: usize) -> Vec<Self> {
        let mut next = self.model.steps(t);
        for state in &mut next {
            (self.fault)(&self.model, t, state);
        }
        next.into_iter()
            .map(|model| Faulty {
                model,
                fault: self.fault,
            })
            .collect()
    }

    fn finished(&self) -> bool {
        self.model.finished()
    }

    fn check(&self) -> Result<(), &'static str> {
        self.model.check()
    }
}

/// Visits every state reachable from `start`, depth first; fails on the first violation.
pub fn explore<M: Model>(start: M, max_states: usize) -> Result<Explored, Violation<M>> {
    let mut seen = HashSet::new();
    let mut todo = vec![start];
    let mut finished = 0;
    while let Some(state) = todo.pop() {
        if seen.contains(&state) {
            continue;
        }
        if let Err(why) = state.check() {
            return Err(Violation::Invariant { state, why });
        }
        let next: Vec<M> = (0..state.threads()).flat_map(|t| state.steps(t)).collect();
        if next.is_empty() {
            if !state.finished() {
                return Err(Violation::Stuck { state });
            }
            finished += 1;
        }
        todo.extend(next.into_iter().filter(|s| !seen.contains(s)));
        seen.insert(state);
        if seen.len() > max_states {
            return Err(Violation::TooLarge { states: seen.len() });
        }
    }
    Ok(Explored {
        states: seen.len(),
        finished,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two threads that each increment a counter once; a lost update is not modelled, so
    /// every path ends finished at 2.
    #[derive(Clone, PartialEq, Eq, Hash, Debug)]
    struct Counter {
        done: [bool; 2],
        value: u8,
        stuck_after_first: bool,
    }

    impl Model for Counter {
        fn threads(&self) -> usize {
            2
        }
        fn steps(&self, t: usize) -> Vec<Self> {
            if self.done[t] || (self.stuck_after_first && self.value == 1) {
                return Vec::new();
            }
            let mut s = self.clone();
            s.done[t] = true;
            s.value += 1;
            vec![s]
        }
        fn finished(&self) -> bool {
            self.done == [true, true]
        }
        fn check(&self) -> Result<(), &'static str> {
            (self.value <= 2).then_some(()).ok_or("counted past 2")
        }
    }

    #[test]
    fn the_explorer_finds_every_state_and_reports_a_stuck_one() {
        let ok = Counter {
            done: [false; 2],
            value: 0,
            stuck_after_first: false,
        };
        assert_eq!(
            explore(ok.clone(), 100),
            Ok(Explored {
                states: 4,
                finished: 1
            })
        );
        let stuck = Counter {
            stuck_after_first: true,
            ..ok
        };
        assert!(matches!(explore(stuck, 100), Err(Violation::Stuck { .. })));
    }
}
