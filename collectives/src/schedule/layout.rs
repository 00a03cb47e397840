//! Where a schedule's logical buffers lie in memory.
//!
//! A schedule addresses [`BufId::Input`], [`BufId::Output`] and [`BufId::Scratch`] by element
//! offsets. A collective maps each onto one place; a group of sends and receives lays its send
//! buffers end to end as Input and its receive buffers end to end as Output. [`BufferMap`] is
//! that map, generic over what a place is: an area and byte offset on the host
//! ([`Placement`]), a device address on a GPU.

use super::BufId;

/// A place in host memory: byte `offset` into area `area` (the areas are the caller's buffers
/// and the scratch space, numbered by whoever executes the schedule).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Placement {
    pub area: usize,
    pub offset: usize,
}

impl Placement {
    /// Byte `offset` of area `area`.
    pub const fn new(area: usize, offset: usize) -> Self {
        Placement { area, offset }
    }
}

/// Where each logical buffer of a schedule starts, as places of type `P`. A collective's map
/// ([`BufferMap::fixed`]) allocates nothing: the host builds one per call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferMap<P> {
    input: Buffers<P>,
    output: Buffers<P>,
    scratch: Option<P>,
}

/// One logical buffer's memory: one place, or several buffers laid end to end.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Buffers<P> {
    One(P),
    /// (first element, place) of every non-empty buffer, by increasing first element; the
    /// element after the last buffer.
    EndToEnd {
        starts: Vec<(usize, P)>,
        end: usize,
    },
}

impl<P> Default for Buffers<P> {
    fn default() -> Self {
        Buffers::EndToEnd {
            starts: Vec::new(),
            end: 0,
        }
    }
}

impl<P> Default for BufferMap<P> {
    fn default() -> Self {
        BufferMap {
            input: Buffers::default(),
            output: Buffers::default(),
            scratch: None,
        }
    }
}

impl<P: Copy> Buffers<P> {
    fn push(&mut self, at: P, len: usize) -> usize {
        match self {
            Buffers::One(first) => {
                // A single buffer extended: it held every offset, so it stays first and
                // unbounded.
                *self = Buffers::EndToEnd {
                    starts: vec![(0, *first)],
                    end: usize::MAX,
                };
                self.push(at, len)
            }
            Buffers::EndToEnd { starts, end } => {
                let start = *end;
                // An empty buffer holds no element: nothing can resolve to it.
                if len > 0 {
                    starts.push((start, at));
                }
                *end = start.saturating_add(len);
                start
            }
        }
    }

    fn locate(&self, offset: usize) -> Option<(P, usize)> {
        match self {
            Buffers::One(at) => Some((*at, offset)),
            Buffers::EndToEnd { starts, .. } => {
                // The last buffer starting at or before `offset` holds it.
                let i = starts.partition_point(|&(start, _)| start <= offset);
                let (start, at) = *starts.get(i.checked_sub(1)?)?;
                Some((at, offset - start))
            }
        }
    }
}

impl<P: Copy> BufferMap<P> {
    /// One Input, one Output and (optionally) the scratch space, each one buffer.
    pub fn fixed(input: P, output: P, scratch: Option<P>) -> Self {
        BufferMap {
            input: Buffers::One(input),
            output: Buffers::One(output),
            scratch,
        }
    }

    /// The places of a [`BufferMap::fixed`] map: Input, Output and scratch.
    pub fn fixed_places(&self) -> Option<[P; 3]> {
        match (&self.input, &self.output, self.scratch) {
            (Buffers::One(i), Buffers::One(o), Some(s)) => Some([*i, *o, s]),
            _ => None,
        }
    }

    /// Appends an Input buffer of `len` elements at `at`; returns its first element.
    pub fn push_input(&mut self, at: P, len: usize) -> usize {
        self.input.push(at, len)
    }

    /// Appends an Output buffer of `len` elements at `at`; returns its first element.
    pub fn push_output(&mut self, at: P, len: usize) -> usize {
        self.output.push(at, len)
    }

    /// The buffer holding element `offset` of `buf`, and the element's index inside it (`None`
    /// when no buffer starts at or before it, or there is no scratch space).
    pub fn locate(&self, buf: BufId, offset: usize) -> Option<(P, usize)> {
        match buf {
            BufId::Input => self.input.locate(offset),
            BufId::Output => self.output.locate(offset),
            BufId::Scratch => self.scratch.map(|s| (s, offset)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn end_to_end_buffers_resolve_to_their_own_place() {
        let mut map = BufferMap::<u64>::default();
        assert_eq!(map.push_input(0x100, 4), 0);
        assert_eq!(map.push_input(0x200, 0), 4);
        assert_eq!(map.push_input(0x300, 2), 4);
        assert_eq!(map.push_output(0x400, 3), 0);
        assert_eq!(map.locate(BufId::Input, 0), Some((0x100, 0)));
        assert_eq!(map.locate(BufId::Input, 3), Some((0x100, 3)));
        assert_eq!(map.locate(BufId::Input, 4), Some((0x300, 0)));
        assert_eq!(map.locate(BufId::Input, 5), Some((0x300, 1)));
        assert_eq!(map.locate(BufId::Output, 2), Some((0x400, 2)));
        assert_eq!(map.locate(BufId::Scratch, 0), None);
        assert_eq!(BufferMap::<u64>::default().locate(BufId::Input, 0), None);
    }

    #[test]
    fn fixed_buffers_take_every_offset() {
        let map = BufferMap::fixed(
            Placement::new(2, 8),
            Placement::new(0, 16),
            Some(Placement::new(1, 0)),
        );
        assert_eq!(map.locate(BufId::Input, 5), Some((Placement::new(2, 8), 5)));
        assert_eq!(
            map.locate(BufId::Output, 0),
            Some((Placement::new(0, 16), 0))
        );
        assert_eq!(
            map.locate(BufId::Scratch, 9),
            Some((Placement::new(1, 0), 9))
        );
    }
}
