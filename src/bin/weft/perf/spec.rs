//! Pure parts of `weft perf`: sizes, per-collective counts and bus-bandwidth factors, validation
//! patterns with their expected values, and nccl-tests-style formatting.

use weftcc::{DataType, OpKind, ReduceOp};

/// The collectives `weft perf` measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Collective {
    #[value(name = "all-reduce", alias = "allreduce", alias = "all_reduce")]
    AllReduce,
    #[value(name = "all-gather", alias = "allgather", alias = "all_gather")]
    AllGather,
    #[value(
        name = "reduce-scatter",
        alias = "reducescatter",
        alias = "reduce_scatter"
    )]
    ReduceScatter,
    #[value(name = "broadcast")]
    Broadcast,
    #[value(name = "reduce")]
    Reduce,
    #[value(name = "all-to-all", alias = "alltoall", alias = "all_to_all")]
    AllToAll,
    #[value(name = "sendrecv", alias = "send-recv", alias = "send_recv")]
    SendRecv,
}

/// Element count per rank and the size column (bytes) of one row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    /// Per-rank element count (the block size for all-gather, reduce-scatter and all-to-all).
    pub count: u64,
    /// Bytes of the largest buffer a rank sees: the `size` column and the numerator of algbw.
    pub bytes: u64,
}

impl Collective {
    pub const fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all-reduce",
            Collective::AllGather => "all-gather",
            Collective::ReduceScatter => "reduce-scatter",
            Collective::Broadcast => "broadcast",
            Collective::Reduce => "reduce",
            Collective::AllToAll => "all-to-all",
            Collective::SendRecv => "sendrecv",
        }
    }

    /// The operation this benchmark runs.
    pub const fn kind(self) -> OpKind {
        match self {
            Collective::AllReduce => OpKind::AllReduce,
            Collective::AllGather => OpKind::AllGather,
            Collective::ReduceScatter => OpKind::ReduceScatter,
            Collective::Broadcast => OpKind::Broadcast,
            Collective::Reduce => OpKind::Reduce,
            Collective::AllToAll => OpKind::AllToAll,
            Collective::SendRecv => OpKind::SendRecv,
        }
    }

    /// True for the collectives that apply a reduction (and so take `-o`).
    pub const fn reduces(self) -> bool {
        self.kind().has_reduction()
    }

    /// True for the collectives with a root (and so take `-r`).
    pub const fn has_root(self) -> bool {
        self.kind().has_root()
    }

    /// True when the size column counts the buffer of all ranks' blocks (count × type × nranks).
    const fn full_buffer(self) -> bool {
        matches!(
            self,
            Collective::AllGather | Collective::ReduceScatter | Collective::AllToAll
        )
    }

    /// busbw / algbw for `n` ranks.
    pub fn bus_factor(self, n: u64) -> f64 {
        let n = n as f64;
        match self {
            Collective::AllReduce => 2.0 * (n - 1.0) / n,
            Collective::AllGather | Collective::ReduceScatter | Collective::AllToAll => {
                (n - 1.0) / n
            }
            Collective::Broadcast | Collective::Reduce | Collective::SendRecv => 1.0,
        }
    }

    /// The row for a requested `size` in bytes, rounded down to whole elements (and whole blocks
    /// per rank); None when no element fits.
    pub fn counts(self, size: u64, type_size: u64, n: u64) -> Option<Counts> {
        let unit = if self.full_buffer() {
            type_size * n
        } else {
            type_size
        };
        let count = size / unit;
        (count > 0).then_some(Counts {
            count,
            bytes: count * unit,
        })
    }

    /// Element lengths of the (send, receive) buffers of the out-of-place call.
    pub fn buffer_lens(self, count: usize, n: usize) -> (usize, usize) {
        match self {
            Collective::AllGather => (count, n * count),
            Collective::ReduceScatter => (n * count, count),
            Collective::AllToAll => (n * count, n * count),
            _ => (count, count),
        }
    }

    /// Element length of the buffer of the in-place call. Send/recv's in-place variant uses one
    /// buffer of 2 × count: it sends the first half and receives into the second.
    pub fn in_place_len(self, count: usize, n: usize) -> usize {
        match self {
            Collective::AllGather | Collective::ReduceScatter | Collective::AllToAll => n * count,
            Collective::SendRecv => 2 * count,
            _ => count,
        }
    }

    /// The range of the in-place buffer that holds the result on rank `me`.
    pub fn in_place_output(self, count: usize, n: usize, me: usize) -> (usize, usize) {
        match self {
            Collective::ReduceScatter => (me * count, (me + 1) * count),
            Collective::SendRecv => (count, 2 * count),
            _ => (0, self.in_place_len(count, n)),
        }
    }
}

/// Parses a byte size (`8`, `1K`, `128M`, `64KiB`, `1.5M`): the one grammar every weftcc size
/// uses ([`weftcc::transports::parse_size`]), as clap's value parser.
pub fn parse_size(s: &str) -> Result<u64, weftcc::transports::InvalidSize> {
    weftcc::transports::parse_size(s).map(|v| v as u64)
}

/// The sizes from `min` to `max`: multiplied by `factor` (default 2, or 1 when `increment` is
/// given), or with factor 1 increased by `increment` (default 1 MiB). Also returns the header's
/// `step:` text.
pub fn size_sweep(
    min: u64,
    max: u64,
    factor: Option<u64>,
    increment: Option<u64>,
) -> Result<(Vec<u64>, String), String> {
    const MAX_ROWS: usize = 100_000;
    let factor = factor.unwrap_or(if increment.is_some() { 1 } else { 2 });
    if factor == 0 {
        return Err("-f must be at least 1".into());
    }
    let step = increment.unwrap_or(1 << 20);
    if factor == 1 && step == 0 {
        return Err("-i must be at least 1".into());
    }
    let text = if factor > 1 {
        format!("{factor}(factor)")
    } else {
        format!("{step}(bytes)")
    };
    let mut sizes = Vec::new();
    let mut size = min;
    while size <= max {
        if sizes.len() == MAX_ROWS {
            return Err(format!(
                "the sweep from {min} to {max} has more than {MAX_ROWS} sizes"
            ));
        }
        sizes.push(size);
        let next = if factor > 1 {
            size.checked_mul(factor).map(|s| s.max(size + 1))
        } else {
            size.checked_add(step)
        };
        match next {
            Some(s) => size = s,
            None => break,
        }
    }
    Ok((sizes, text))
}

/// The largest integer L such that every integer in [0, L] is exact in the type (and, for
/// integers, does not overflow). 64-bit integers are capped at 2^53 because expected values are
/// computed in f64.
fn exact_limit(t: DataType) -> u64 {
    match t {
        DataType::Int8 => i8::MAX as u64,
        DataType::Uint8 => u8::MAX as u64,
        DataType::Int32 => i32::MAX as u64,
        DataType::Uint32 => u32::MAX as u64,
        DataType::Int64 | DataType::Uint64 | DataType::Float64 => 1 << 53,
        DataType::Float16 => 1 << 11,
        DataType::Bfloat16 => 1 << 8,
        DataType::Float32 => 1 << 24,
    }
}

/// The largest e such that 2^e is exact in the type and does not overflow it (capped at 52).
fn max_pow2(t: DataType) -> u64 {
    match t {
        DataType::Int8 => 6,
        DataType::Uint8 => 7,
        DataType::Int32 => 30,
        DataType::Uint32 => 31,
        DataType::Float16 => 15,
        _ => 52,
    }
}

/// The validation input: rank `r`'s element `i` is a small non-negative integer chosen so that
/// every partial result of the reduction (in any order) is an integer the type represents exactly
/// without overflow. Then the collective's result does not depend on the order of the reduction,
/// the expected value computed here in f64 is exact, and comparing for equality is right.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pattern {
    kind: PatternKind,
    n: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PatternKind {
    /// (7r + 3i) mod m, values 0..m-1; for sums n × (m-1) stays within the exact range.
    Modular { m: u64 },
    /// (3i mod k) + 2((r + i) mod n): the sum over ranks is n(3i mod k) + n(n-1), a multiple of
    /// n, so the average is an exact integer too.
    AvgSpread { k: u64 },
    /// 3i mod k on every rank (average with too many ranks for `AvgSpread` to fit the type).
    Uniform { k: u64 },
    /// 2 where (r + i) mod p = 0, else 1: a product over ranks is a power of two with at most
    /// ceil(n/p) factors of 2, which p keeps within the type.
    Powers { p: u64 },
}

impl Pattern {
    /// The pattern for reduction `op` (None: no reduction) of type `t` over `n` ranks.
    pub fn new(t: DataType, op: Option<ReduceOp>, n: usize) -> Pattern {
        let n = n.max(1) as u64;
        let limit = exact_limit(t);
        let kind = match op {
            Some(ReduceOp::Prod) => PatternKind::Powers {
                p: n.div_ceil(max_pow2(t)).max(2),
            },
            Some(ReduceOp::Avg) => {
                let per_rank = limit / n;
                if per_rank >= n - 1 {
                    PatternKind::AvgSpread {
                        k: (per_rank - (n - 1) + 1).min(11),
                    }
                } else {
                    PatternKind::Uniform {
                        k: (per_rank + 1).min(11),
                    }
                }
            }
            Some(ReduceOp::Sum) | Some(ReduceOp::PreMulSum(_)) => PatternKind::Modular {
                m: (limit / n + 1).min(11),
            },
            Some(ReduceOp::Min) | Some(ReduceOp::Max) | None => PatternKind::Modular { m: 11 },
        };
        Pattern { kind, n }
    }

    /// Element `i` of rank `r`'s input.
    pub fn value(&self, r: usize, i: usize) -> f64 {
        let (r, i) = (r as u64, i as u64);
        let v = match self.kind {
            PatternKind::Modular { m } => (7 * (r % m) + 3 * (i % m)) % m,
            PatternKind::AvgSpread { k } => {
                (3 * (i % k)) % k + 2 * ((r % self.n + i % self.n) % self.n)
            }
            PatternKind::Uniform { k } => (3 * (i % k)) % k,
            PatternKind::Powers { p } => {
                if (r % p + i % p) % p == 0 {
                    2
                } else {
                    1
                }
            }
        };
        v as f64
    }
}

/// The reduction of one element over all ranks, exactly (see [`Pattern`]).
pub fn reduce(op: ReduceOp, pattern: &Pattern, n: usize, idx: usize) -> f64 {
    let vals = (0..n).map(|r| pattern.value(r, idx));
    match op {
        ReduceOp::Sum | ReduceOp::PreMulSum(_) => vals.sum(),
        ReduceOp::Prod => vals.product(),
        ReduceOp::Min => vals.fold(f64::INFINITY, f64::min),
        ReduceOp::Max => vals.fold(f64::NEG_INFINITY, f64::max),
        // The patterns make the sum a multiple of n: integer and float division agree.
        ReduceOp::Avg => vals.sum::<f64>() / n as f64,
    }
}

/// Expected element `j` of the output on rank `me` (the receive buffer, or the result range of
/// the in-place buffer, see [`Collective::in_place_output`]); None where nothing is defined
/// (a reduce's non-root ranks).
#[allow(clippy::too_many_arguments)]
pub fn expected(
    c: Collective,
    pattern: &Pattern,
    op: Option<ReduceOp>,
    n: usize,
    me: usize,
    count: usize,
    root: usize,
    j: usize,
) -> Option<f64> {
    let op = op.unwrap_or(ReduceOp::Sum);
    match c {
        Collective::AllReduce => Some(reduce(op, pattern, n, j)),
        Collective::Reduce => (me == root).then(|| reduce(op, pattern, n, j)),
        Collective::Broadcast => Some(pattern.value(root, j)),
        Collective::AllGather => Some(pattern.value(j / count, j % count)),
        Collective::ReduceScatter => Some(reduce(op, pattern, n, me * count + j)),
        Collective::AllToAll => Some(pattern.value(j / count, me * count + j % count)),
        Collective::SendRecv => Some(pattern.value((me + n - 1) % n, j)),
    }
}

/// Initial element `j` of the in-place buffer on rank `me`: the input where the collective reads
/// one, elsewhere a sentinel that differs from the expected result.
pub fn in_place_input(
    c: Collective,
    pattern: &Pattern,
    n: usize,
    me: usize,
    count: usize,
    j: usize,
) -> f64 {
    match c {
        Collective::AllGather if j / count != me => {
            sentinel(Some(pattern.value(j / count, j % count)))
        }
        Collective::AllGather => pattern.value(me, j % count),
        Collective::SendRecv if j >= count => {
            sentinel(Some(pattern.value((me + n - 1) % n, j - count)))
        }
        _ => pattern.value(me, j),
    }
}

/// A value that differs from `expected` (exact in every type), so an element the collective
/// does not write is counted as wrong.
pub fn sentinel(expected: Option<f64>) -> f64 {
    if expected == Some(0.0) {
        1.0
    } else {
        0.0
    }
}

/// Largest accepted |actual - expected|. Zero (exact comparison) everywhere but one case: a float
/// average over a number of ranks that is not a power of two, which an implementation may compute
/// by pre-multiplying every input by 1/n (as NCCL does); 1/n is then inexact and each of the n
/// additions may round once, so allow (n + 2) rounding errors of twice the unit roundoff.
pub fn tolerance(t: DataType, op: Option<ReduceOp>, n: usize, expected: f64) -> f64 {
    if op != Some(ReduceOp::Avg) || !t.is_float() || n.is_power_of_two() {
        return 0.0;
    }
    let unit = match t {
        DataType::Float16 => 2f64.powi(-11),
        DataType::Bfloat16 => 2f64.powi(-8),
        DataType::Float32 => 2f64.powi(-24),
        _ => 2f64.powi(-53),
    };
    2.0 * (n as f64 + 2.0) * unit * expected.abs().max(1.0)
}

/// True when `actual` is within `tol` of `expected` (NaN never matches).
pub fn matches(actual: f64, expected: f64, tol: f64) -> bool {
    (actual - expected).abs() <= tol
}

/// Time, bandwidths and wrong-element count of one half of a row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measured {
    pub time_us: f64,
    /// GB/s (1e9 bytes per second).
    pub algbw: f64,
    pub busbw: f64,
    /// None when checking is off.
    pub wrong: Option<u64>,
}

impl Measured {
    pub fn new(bytes: u64, secs: f64, bus_factor: f64, wrong: Option<u64>) -> Measured {
        let algbw = if secs > 0.0 {
            bytes as f64 / secs / 1e9
        } else {
            0.0
        };
        Measured {
            time_us: secs * 1e6,
            algbw,
            busbw: algbw * bus_factor,
            wrong,
        }
    }
}

/// The three column-header lines (with their trailing newline).
pub const COLUMN_HEADER: &str = "\
#                                                              out-of-place                       in-place          
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)       
";

/// A time in microseconds in 7 columns, with fewer decimals as it grows.
fn format_time(us: f64) -> String {
    if us >= 10_000.0 {
        format!("{us:7.0}")
    } else if us >= 100.0 {
        format!("{us:7.1}")
    } else {
        format!("{us:7.2}")
    }
}

fn format_half(m: &Measured) -> String {
    let wrong = m.wrong.map_or_else(|| "N/A".to_string(), |w| w.to_string());
    format!(
        "  {}  {:6.2}  {:6.2}  {:>5}",
        format_time(m.time_us),
        m.algbw,
        m.busbw,
        wrong
    )
}

/// One result row, aligned under [`COLUMN_HEADER`].
pub fn format_row(
    size: u64,
    count: u64,
    type_name: &str,
    redop: &str,
    root: i64,
    oop: &Measured,
    ip: &Measured,
) -> String {
    format!(
        "{size:>12}  {count:>12}  {type_name:>8}  {redop:>6}  {root:>6}{}{}",
        format_half(oop),
        format_half(ip)
    )
}

/// The header line describing one rank.
pub fn rank_line(rank: usize, pid: u64, host: &str, device: u64) -> String {
    format!("#  Rank {rank:>2} Group  0 Pid {pid:>5} on {host:>10} device {device:>2} [cpu] host memory")
}

/// The footer: wrong values (None: not checked) and the mean bus bandwidth.
pub fn footer(wrong: Option<u64>, avg_busbw: f64) -> String {
    let w = wrong.unwrap_or(0);
    format!(
        "# Out of bounds values : {w} {}\n# Avg bus bandwidth    : {avg_busbw:.3} \n#\n",
        if w == 0 { "OK" } else { "FAILED" }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweeps() {
        let (s, t) = size_sweep(8, 128, None, None).unwrap();
        assert_eq!(s, vec![8, 16, 32, 64, 128]);
        assert_eq!(t, "2(factor)");
        let (s, _) = size_sweep(8, 100, Some(4), None).unwrap();
        assert_eq!(s, vec![8, 32]);
        let (s, t) = size_sweep(1000, 3000, None, Some(1000)).unwrap();
        assert_eq!(s, vec![1000, 2000, 3000]);
        assert_eq!(t, "1000(bytes)");
        let (s, _) = size_sweep(0, 4, None, None).unwrap();
        assert_eq!(s, vec![0, 1, 2, 4]);
        let (s, _) = size_sweep(8, 8, None, None).unwrap();
        assert_eq!(s, vec![8]);
        let (s, _) = size_sweep(1 << 62, u64::MAX, None, None).unwrap();
        assert_eq!(s, vec![1 << 62, 1 << 63]);
        assert!(size_sweep(1, 10, Some(0), None).is_err());
        assert!(size_sweep(1, 10, Some(1), Some(0)).is_err());
        assert_eq!(size_sweep(8, 128 << 20, None, None).unwrap().0.len(), 25);
    }

    #[test]
    fn counts_and_factors() {
        let c = Collective::AllReduce.counts(8, 4, 2).unwrap();
        assert_eq!(c, Counts { count: 2, bytes: 8 });
        assert_eq!(Collective::AllReduce.counts(3, 4, 2), None);
        // All-gather rounds to whole blocks of every rank; count is per rank.
        let c = Collective::AllGather.counts(100, 4, 3).unwrap();
        assert_eq!(
            c,
            Counts {
                count: 8,
                bytes: 96
            }
        );
        assert_eq!(Collective::AllToAll.counts(8, 4, 4), None);
        assert_eq!(Collective::AllReduce.bus_factor(4), 1.5);
        assert_eq!(Collective::AllGather.bus_factor(4), 0.75);
        assert_eq!(Collective::ReduceScatter.bus_factor(2), 0.5);
        assert_eq!(Collective::AllToAll.bus_factor(8), 0.875);
        assert_eq!(Collective::Broadcast.bus_factor(8), 1.0);
        assert_eq!(Collective::SendRecv.bus_factor(8), 1.0);
        assert_eq!(Collective::ReduceScatter.buffer_lens(5, 3), (15, 5));
        assert_eq!(Collective::ReduceScatter.in_place_output(5, 3, 1), (5, 10));
        assert_eq!(Collective::SendRecv.in_place_output(5, 3, 1), (5, 10));
        assert_eq!(Collective::AllGather.in_place_output(5, 3, 1), (0, 15));
    }

    #[test]
    fn measured_bandwidths() {
        let m = Measured::new(1_000_000, 1e-3, 1.5, Some(0));
        assert!((m.time_us - 1000.0).abs() < 1e-9);
        assert!((m.algbw - 1.0).abs() < 1e-12);
        assert!((m.busbw - 1.5).abs() < 1e-12);
    }

    #[test]
    fn row_matches_the_nccl_tests_layout() {
        let oop = Measured {
            time_us: 5.21,
            algbw: 0.0,
            busbw: 0.0,
            wrong: Some(0),
        };
        let ip = Measured {
            time_us: 4.98,
            algbw: 0.0,
            busbw: 0.0,
            wrong: Some(0),
        };
        assert_eq!(
            format_row(8, 2, "float", "sum", -1, &oop, &ip),
            "           8             2     float     sum      -1     5.21    0.00    0.00      0     4.98    0.00    0.00      0"
        );
        let header: Vec<&str> = COLUMN_HEADER.lines().collect();
        let row = format_row(8, 2, "float", "sum", -1, &oop, &ip);
        // Every column ends where its header's title ends.
        assert_eq!(header[1].len(), row.len());
        let big = Measured {
            time_us: 123456.7,
            algbw: 123.456,
            busbw: 0.5,
            wrong: None,
        };
        let r = format_row(1 << 30, 1 << 28, "bfloat16", "none", 0, &big, &big);
        assert_eq!(r.len(), row.len());
        assert!(r.contains(" 123457  123.46    0.50    N/A"));
        assert_eq!(format_time(512.34), "  512.3");
    }

    #[test]
    fn footer_and_rank_line() {
        assert_eq!(
            footer(Some(0), 1.2344),
            "# Out of bounds values : 0 OK\n# Avg bus bandwidth    : 1.234 \n#\n"
        );
        assert!(footer(Some(3), 0.0).contains(": 3 FAILED"));
        assert_eq!(
            rank_line(0, 1234, "hostname", 0),
            "#  Rank  0 Group  0 Pid  1234 on   hostname device  0 [cpu] host memory"
        );
    }

    fn exact_in(t: DataType, v: f64) -> bool {
        t.decode_f64(&t.encode_f64(v)) == Some(v) && v <= exact_limit(t) as f64
    }

    /// Every partial reduction in rank order (and every single value) is exact in the type, for
    /// every type, op and up to 64 ranks; the average is a whole number.
    #[test]
    fn patterns_stay_exact() {
        for t in DataType::ALL {
            for op in ReduceOp::ALL {
                for n in 1..=64usize {
                    let p = Pattern::new(t, Some(op), n);
                    for i in 0..40 {
                        let mut acc: Option<f64> = None;
                        for r in 0..n {
                            let v = p.value(r, i);
                            assert!(exact_in(t, v), "{t} {op} n={n} value {v}");
                            let a = match (acc, op) {
                                (None, _) => v,
                                (Some(a), ReduceOp::Prod) => a * v,
                                (Some(a), ReduceOp::Min) => a.min(v),
                                (Some(a), ReduceOp::Max) => a.max(v),
                                (Some(a), _) => a + v,
                            };
                            // Powers of two are exact in floats beyond the integer range.
                            let ok = if op == ReduceOp::Prod && t.is_float() {
                                a <= 2f64.powi(max_pow2(t) as i32)
                            } else {
                                exact_in(t, a)
                            };
                            assert!(ok, "{t} {op} n={n} i={i} partial {a}");
                            acc = Some(a);
                        }
                        let e = reduce(op, &p, n, i);
                        assert_eq!(e.fract(), 0.0, "{t} {op} n={n}");
                        assert!(exact_in(t, e) || (op == ReduceOp::Prod && t.is_float()));
                    }
                }
            }
        }
    }

    #[test]
    fn patterns_vary_with_rank_and_index() {
        let p = Pattern::new(DataType::Float32, Some(ReduceOp::Sum), 8);
        assert_eq!(p.value(0, 0), 0.0);
        assert_eq!(p.value(1, 0), 7.0);
        assert_eq!(p.value(1, 2), 2.0);
        assert_ne!(
            reduce(ReduceOp::Sum, &p, 8, 0),
            reduce(ReduceOp::Sum, &p, 8, 1)
        );
        let p = Pattern::new(DataType::Int8, Some(ReduceOp::Prod), 8);
        assert!((0..8).any(|i| reduce(ReduceOp::Prod, &p, 8, i) > 1.0));
        let p = Pattern::new(DataType::Bfloat16, Some(ReduceOp::Avg), 3);
        assert!((0..3).any(|r| p.value(r, 0) != p.value(0, 0)));
    }

    #[test]
    fn expected_values_of_each_collective() {
        let p = Pattern::new(DataType::Float32, None, 4);
        // All-gather: block s of the output is rank s's input.
        assert_eq!(
            expected(Collective::AllGather, &p, None, 4, 1, 3, 0, 7),
            Some(p.value(2, 1))
        );
        // All-to-all on rank 1: block s is block 1 of rank s's input.
        assert_eq!(
            expected(Collective::AllToAll, &p, None, 4, 1, 3, 0, 7),
            Some(p.value(2, 3 + 1))
        );
        assert_eq!(
            expected(Collective::SendRecv, &p, None, 4, 0, 3, 0, 2),
            Some(p.value(3, 2))
        );
        assert_eq!(
            expected(Collective::Broadcast, &p, None, 4, 0, 3, 2, 1),
            Some(p.value(2, 1))
        );
        let ps = Pattern::new(DataType::Float32, Some(ReduceOp::Sum), 4);
        assert_eq!(
            expected(Collective::Reduce, &ps, Some(ReduceOp::Sum), 4, 1, 3, 0, 1),
            None
        );
        let sum: f64 = (0..4).map(|r| ps.value(r, 2 * 3 + 1)).sum();
        assert_eq!(
            expected(
                Collective::ReduceScatter,
                &ps,
                Some(ReduceOp::Sum),
                4,
                2,
                3,
                0,
                1
            ),
            Some(sum)
        );
        // In-place inputs: other ranks' blocks hold sentinels.
        for j in 0..12 {
            let e = expected(Collective::AllGather, &p, None, 4, 1, 3, 0, j).unwrap();
            let v = in_place_input(Collective::AllGather, &p, 4, 1, 3, j);
            assert_eq!(v == e, j / 3 == 1);
        }
    }

    #[test]
    fn tolerances() {
        assert_eq!(
            tolerance(DataType::Float32, Some(ReduceOp::Sum), 3, 10.0),
            0.0
        );
        assert_eq!(
            tolerance(DataType::Int32, Some(ReduceOp::Avg), 3, 10.0),
            0.0
        );
        assert_eq!(
            tolerance(DataType::Float32, Some(ReduceOp::Avg), 4, 10.0),
            0.0
        );
        assert!(tolerance(DataType::Bfloat16, Some(ReduceOp::Avg), 3, 10.0) < 1.0);
        assert!(tolerance(DataType::Float32, Some(ReduceOp::Avg), 3, 10.0) > 0.0);
        assert!(matches(1.0, 1.0, 0.0));
        assert!(!matches(f64::NAN, 1.0, 0.5));
        assert!(!matches(2.0, 1.0, 0.5));
    }
}
