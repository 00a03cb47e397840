//! The byte ring's counters and the rules its two ends follow, without the memory they live in.
//!
//! A ring of `cap` bytes (a power of two) is described by two monotonic counters: `head`, the
//! bytes the sender has written (it alone stores it), and `tail`, the bytes the receiver has
//! consumed (it alone stores it). Each end keeps its own counter and the other's as last read,
//! a lower bound of the real one: a stale value only under-states data or space. The shared-memory
//! transport ([`crate::shm`]) runs these rules over counters in a mapped segment; this module's
//! tests run them over every interleaving of a small ring (`weftcc_testkit::model`).

/// Why a counter read from the other end cannot be right.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RingCorrupt {
    /// The receiver's tail is ahead of the sender's head.
    TailAheadOfHead,
    /// The sender's head is more than a ring ahead of the receiver's tail.
    HeadBeyondCapacity,
}

/// The sender's end: its head and the receiver's tail as last read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct SendCursor {
    pub head: u64,
    pub tail_seen: u64,
}

impl SendCursor {
    /// Whether the tail must be read again before writing `len` bytes: the space known from the
    /// last read is not enough. (The tail sits on a line the receiver keeps writing; re-reading
    /// it only when needed keeps that line from travelling on every write.)
    pub fn needs_tail(&self, len: usize, cap: usize) -> bool {
        let used = self.head.wrapping_sub(self.tail_seen);
        (cap as u64).saturating_sub(used) < len as u64
    }

    /// The bytes of a `len`-byte write that fit now, and where in the ring they start.
    pub fn writable(&self, len: usize, cap: usize) -> Result<(usize, usize), RingCorrupt> {
        let used = self.head.wrapping_sub(self.tail_seen);
        if used > cap as u64 {
            return Err(RingCorrupt::TailAheadOfHead);
        }
        let at = (self.head & (cap as u64 - 1)) as usize;
        Ok((len.min(cap - used as usize), at))
    }

    /// Records `n` bytes written; the new head is to be published.
    pub fn wrote(&mut self, n: usize) -> u64 {
        self.head = self.head.wrapping_add(n as u64);
        self.head
    }
}

/// The receiver's end: its tail, the sender's head as last read, and how much of the tail the
/// sender has been told.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct RecvCursor {
    pub tail: u64,
    /// The sender's head as last read: re-read only when the bytes it announced are used up, so
    /// that while the sender is ahead the line it keeps writing does not travel for every read.
    pub head_seen: u64,
    /// The last reader took less than it was offered (e.g. the start of an element whose rest
    /// is still to come): the next read looks at the head again.
    pub stopped_short: bool,
    /// The tail as last published to the sender.
    pub tail_published: u64,
}

impl RecvCursor {
    /// A receiver that has consumed `tail` bytes, all of them published.
    pub fn at(tail: u64) -> Self {
        RecvCursor {
            tail,
            head_seen: tail,
            stopped_short: false,
            tail_published: tail,
        }
    }

    /// Whether the head must be read again before this read.
    pub fn needs_head(&self) -> bool {
        self.head_seen == self.tail || self.stopped_short
    }

    /// Readable bytes up to `head` (at most `head_seen`, lowered by a pending message or
    /// reference), and where in the ring they start.
    pub fn readable(&self, head: u64, cap: usize) -> Result<(u64, usize), RingCorrupt> {
        let avail = head.wrapping_sub(self.tail);
        if avail > cap as u64 {
            return Err(RingCorrupt::HeadBeyondCapacity);
        }
        Ok((avail, (self.tail & (cap as u64 - 1)) as usize))
    }

    /// How many consumed bytes may wait unpublished in a ring of `cap` bytes: an eighth.
    pub fn release_every(cap: usize) -> u64 {
        (cap / 8) as u64
    }

    /// Advances the tail past the `used` of `offered` bytes; returns whether to publish it now.
    /// The tail reaches the sender (a store to a line it reads, and its doorbell) only when it
    /// may matter: every known byte is consumed (the sender may be waiting for space), the
    /// reader stopped short (it may not come back soon), or `release_every` bytes are waiting
    /// to be released ([`RecvCursor::release_every`]). While the sender is ahead, small reads
    /// then cost no store and no locked instruction each.
    pub fn consumed(&mut self, used: usize, offered: usize, release_every: u64) -> bool {
        self.stopped_short = used < offered;
        self.tail = self.tail.wrapping_add(used as u64);
        let unpublished = self.tail.wrapping_sub(self.tail_published);
        unpublished > 0
            && (self.stopped_short || self.tail == self.head_seen || unpublished >= release_every)
    }

    /// The tail to publish, if the sender does not know it yet (it is then marked published).
    pub fn publish(&mut self) -> Option<u64> {
        (self.tail_published != self.tail).then(|| {
            self.tail_published = self.tail;
            self.tail
        })
    }
}

/// The ring and its doorbells under every interleaving: one sender streams bytes through a
/// small ring, one receiver consumes them in whole elements, each sleeping on its own doorbell
/// when it cannot move. The steps mirror `shm::ShmConnection::try_send`, `try_recv`,
/// `publish_tail`, `Mapping::ring_doorbell` and `ShmWaiter::wait_doorbell`, and the decisions are
/// the ones above. The checks: the sender never overwrites a byte the receiver has not
/// consumed, the receiver reads every byte in order and exactly once, and no interleaving leaves
/// a side asleep with work to do (the lazily published tail and the doorbells' handshake).
#[cfg(test)]
mod model {
    use super::*;
    use weftcc_testkit::model::{explore, Faulty, Model, Violation};

    /// A doorbell (`H_DOORBELL`) and its sleeping count (`H_SLEEPING`), one per segment.
    #[derive(Clone, Copy, Default, PartialEq, Eq, Hash, Debug)]
    struct Bell {
        rung: u32,
        sleeping: u32,
    }

    /// Where a side's waiter is (`ShmWaiter::wait_doorbell` without a timeout).
    #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
    enum Wait {
        /// `sleeping += 1` next.
        Enter,
        /// `cur = rung` next; sleep if it equals `last`.
        Look,
        /// In `FUTEX_WAIT` on `rung == cur`, until woken.
        Asleep,
        /// `sleeping -= 1` next.
        Leave,
        /// `last = rung` next, then back to work.
        Ack,
    }

    /// Where a side is in ringing the other side's doorbell (`Mapping::ring_doorbell`).
    #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
    enum Ring {
        /// `rung += 1` next.
        Add,
        /// `sleeping` is read next; wake if non-zero.
        Check,
        /// `FUTEX_WAKE` next.
        Wake,
    }

    #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
    enum Pc {
        /// Deciding what to do next (includes the re-read of the other side's counter).
        Work,
        /// Data copied, the counter store is next (sender: head; receiver: tail).
        Store {
            value: u64,
            then_wait: bool,
        },
        Ringing {
            ring: Ring,
            then_wait: bool,
        },
        Waiting(Wait),
        Done,
    }

    #[derive(Clone, PartialEq, Eq, Hash, Debug)]
    struct RingModel {
        cap: usize,
        /// Unpublished bytes the receiver lets wait: a whole ring, so that only the rule's
        /// other conditions publish (the real eighth only publishes sooner).
        release_every: u64,
        total: u64,
        /// The largest write the sender attempts, and the receiver's element size.
        write: usize,
        elem: usize,
        /// Shared: the counters in the receiver's segment, the ring's bytes (stream position
        /// of the byte each holds), the receiver's doorbell (rx) and the sender's (tx).
        head: u64,
        tail: u64,
        bytes: Vec<Option<u64>>,
        rx_bell: Bell,
        tx_bell: Bell,
        /// The sender's and the receiver's private state.
        send: SendCursor,
        send_pc: Pc,
        send_last: u32,
        recv: RecvCursor,
        recv_pc: Pc,
        recv_last: u32,
    }

    const SENDER: usize = 0;

    impl RingModel {
        fn new(cap: usize, total: u64, write: usize, elem: usize) -> Self {
            RingModel {
                cap,
                release_every: cap as u64,
                total,
                write,
                elem,
                head: 0,
                tail: 0,
                bytes: vec![None; cap],
                rx_bell: Bell::default(),
                tx_bell: Bell::default(),
                send: SendCursor::default(),
                send_pc: Pc::Work,
                send_last: 0,
                recv: RecvCursor::at(0),
                recv_pc: Pc::Work,
                recv_last: 0,
            }
        }

        fn pc(&mut self, t: usize) -> &mut Pc {
            if t == SENDER {
                &mut self.send_pc
            } else {
                &mut self.recv_pc
            }
        }

        /// The doorbell a side sleeps on, and the one it rings.
        fn bells(&mut self, t: usize) -> (&mut Bell, &mut Bell) {
            if t == SENDER {
                (&mut self.tx_bell, &mut self.rx_bell)
            } else {
                (&mut self.rx_bell, &mut self.tx_bell)
            }
        }

        fn last(&mut self, t: usize) -> &mut u32 {
            if t == SENDER {
                &mut self.send_last
            } else {
                &mut self.recv_last
            }
        }

        /// `FUTEX_WAKE` on the doorbell side `t` sleeps on: every sleeper gets up.
        fn wake(&mut self, t: usize) {
            let pc = self.pc(t);
            if *pc == Pc::Waiting(Wait::Asleep) {
                *pc = Pc::Waiting(Wait::Leave);
            }
        }

        fn send_work(&mut self) {
            let len = self.write.min((self.total - self.send.head) as usize);
            if len == 0 {
                self.send_pc = Pc::Done;
                return;
            }
            if self.send.needs_tail(len, self.cap) {
                self.send.tail_seen = self.tail;
            }
            let (n, at) = self.send.writable(len, self.cap).expect("tail <= head");
            if n == 0 {
                self.send_pc = Pc::Waiting(Wait::Enter);
                return;
            }
            for i in 0..n {
                self.bytes[(at + i) % self.cap] = Some(self.send.head + i as u64);
            }
            let head = self.send.wrote(n);
            self.send_pc = Pc::Store {
                value: head,
                then_wait: false,
            };
        }

        /// The receiver's work steps; several successors where the reader chooses how many
        /// whole elements to take.
        fn recv_work(&self) -> Vec<Self> {
            let mut s = self.clone();
            if s.recv.tail == s.total {
                s.recv_pc = Pc::Done;
                return vec![s];
            }
            if s.recv.needs_head() {
                s.recv.head_seen = s.head;
            }
            let (avail, at) = s
                .recv
                .readable(s.recv.head_seen, s.cap)
                .expect("head in range");
            if avail == 0 {
                s.publish_then(true);
                return vec![s];
            }
            let offered = (avail as usize).min(s.cap - at);
            // The reader takes whole elements, at least one where one is offered (taking none
            // of a whole element means it is not reading from this peer now).
            let least = usize::from(offered >= s.elem);
            (least..=offered / s.elem)
                .map(|k| {
                    let mut t = s.clone();
                    let used = k * t.elem;
                    for i in 0..used {
                        let expected = t.recv.tail + i as u64;
                        if t.bytes[(at + i) % t.cap] != Some(expected) {
                            // Recorded by invalidating the stream; `check` reports it.
                            t.total = u64::MAX;
                        }
                        t.bytes[(at + i) % t.cap] = None;
                    }
                    let publish = t.recv.consumed(used, offered, t.release_every);
                    if publish {
                        t.publish_then(used == 0);
                    } else if used == 0 {
                        t.recv_pc = Pc::Waiting(Wait::Enter);
                    }
                    t
                })
                .collect()
        }

        /// `publish_tail`, then wait (no progress) or work on.
        fn publish_then(&mut self, then_wait: bool) {
            self.recv_pc = match self.recv.publish() {
                Some(tail) => Pc::Store {
                    value: tail,
                    then_wait,
                },
                None if then_wait => Pc::Waiting(Wait::Enter),
                None => Pc::Work,
            };
        }
    }

    impl Model for RingModel {
        fn threads(&self) -> usize {
            2
        }

        fn steps(&self, t: usize) -> Vec<Self> {
            let mut s = self.clone();
            match *s.pc(t) {
                Pc::Done | Pc::Waiting(Wait::Asleep) => return Vec::new(),
                Pc::Work if t == SENDER => s.send_work(),
                Pc::Work => return s.recv_work(),
                Pc::Store { value, then_wait } => {
                    if t == SENDER {
                        s.head = value;
                    } else {
                        s.tail = value;
                    }
                    *s.pc(t) = Pc::Ringing {
                        ring: Ring::Add,
                        then_wait,
                    };
                }
                Pc::Ringing { ring, then_wait } => {
                    let next = |ring| Pc::Ringing { ring, then_wait };
                    let after = if then_wait {
                        Pc::Waiting(Wait::Enter)
                    } else {
                        Pc::Work
                    };
                    *s.pc(t) = match ring {
                        Ring::Add => {
                            s.bells(t).1.rung += 1;
                            next(Ring::Check)
                        }
                        Ring::Check if s.bells(t).1.sleeping != 0 => next(Ring::Wake),
                        Ring::Check => after,
                        Ring::Wake => {
                            s.wake(1 - t);
                            after
                        }
                    };
                }
                Pc::Waiting(wait) => {
                    let last = *s.last(t);
                    let (own, _) = s.bells(t);
                    let next = match wait {
                        Wait::Enter => {
                            own.sleeping += 1;
                            Pc::Waiting(Wait::Look)
                        }
                        // FUTEX_WAIT compares and sleeps atomically with respect to wakes.
                        Wait::Look if own.rung == last => Pc::Waiting(Wait::Asleep),
                        Wait::Look => Pc::Waiting(Wait::Leave),
                        Wait::Leave => {
                            own.sleeping -= 1;
                            Pc::Waiting(Wait::Ack)
                        }
                        Wait::Ack => {
                            let rung = own.rung;
                            *s.last(t) = rung;
                            Pc::Work
                        }
                        Wait::Asleep => unreachable!("handled above"),
                    };
                    *s.pc(t) = next;
                }
            }
            vec![s]
        }

        fn finished(&self) -> bool {
            self.send_pc == Pc::Done && self.recv_pc == Pc::Done
        }

        fn check(&self) -> Result<(), &'static str> {
            if self.total == u64::MAX {
                return Err("the receiver read a byte that is not the next in the stream");
            }
            if self.send.head.wrapping_sub(self.recv.tail) > self.cap as u64 {
                return Err("the sender overwrote bytes the receiver had not consumed");
            }
            Ok(())
        }
    }

    #[test]
    fn every_interleaving_delivers_the_stream_and_nobody_sleeps_through_work() {
        // 16 bytes: the tail is published as lazily as the rule allows, writes of up to
        // 5 bytes wrap around the ring, elements of 2 bytes leave odd remainders unread.
        let explored =
            explore(RingModel::new(16, 22, 5, 2), 20_000_000).unwrap_or_else(|v| panic!("{v}"));
        assert!(
            explored.finished > 0 && explored.states > 1000,
            "{explored:?}"
        );
    }

    #[test]
    fn the_model_finds_a_receiver_that_never_publishes_its_tail() {
        // A receiver that keeps its tail to itself starves a sender that fills the ring: the
        // exploration must report it stuck (the check can fail).
        let never_publish = Faulty {
            model: RingModel::new(8, 12, 8, 1),
            fault: |_, _, after| after.tail = 0,
        };
        let result = explore(never_publish, 1_000_000);
        assert!(matches!(result, Err(Violation::Stuck { .. })), "{result:?}");
    }
}
