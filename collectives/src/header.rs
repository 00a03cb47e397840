//! The operation header: 40 bytes a rank sends to every peer it sends to in an operation (even
//! with no data), before the data, so that mismatched calls are detected instead of corrupting
//! data or hanging.

use crate::call::RawOp;
use crate::dtype::DataType;
use crate::op::OpKind;
use std::fmt;

/// Size of an encoded header. A multiple of 8 so the data after it stays 8-byte aligned, and
/// small enough that a header with 8 bytes of data fits the 48 data bytes of the first line of
/// a shared-memory low-latency message (one cache line, one transfer).
pub const HEADER_LEN: usize = 40;
const MAGIC: [u8; 4] = *b"WFOP";
const VERSION: u8 = 3;
/// The reduction byte of a header whose operation does not reduce.
const NO_REDOP: u8 = 0xff;
/// Root value meaning "no root".
pub const NO_ROOT: u32 = u32::MAX;

/// What an operation is, as ranks compare it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpDesc {
    pub kind: OpKind,
    /// Per-kind sequence number: collectives count calls on the communicator, point-to-point
    /// operations count messages between one ordered pair of ranks.
    pub seq: u64,
    pub dtype: DataType,
    pub count: u64,
    /// Wire code of the reduction ([`crate::ReduceOp::code`]) where the kind reduces.
    pub redop: Option<u8>,
    pub root: u32,
}

impl OpDesc {
    /// The description of collective `call`, the `seq`-th of its communicator: the reduction
    /// only where the kind reduces, the root only where it has one
    /// ([`NO_ROOT`] otherwise), so that fields a call ignores never make ranks disagree.
    #[inline]
    pub fn of_call(call: &RawOp, seq: u64) -> OpDesc {
        OpDesc {
            kind: call.kind,
            seq,
            dtype: call.dtype,
            count: call.count as u64,
            redop: call.has_reduction().then(|| call.op.code()),
            root: if call.has_root() {
                u32::try_from(call.root).unwrap_or(NO_ROOT)
            } else {
                NO_ROOT
            },
        }
    }

    /// Encodes the header sent by `sender`.
    #[inline]
    pub fn encode(&self, sender: u32) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        self.encode_into(sender, &mut b);
        b
    }

    /// [`OpDesc::encode`] into `b`. The checksum is taken over the words as computed, not read
    /// back from `b` (reading bytes just stored one by one as words stalls the load).
    #[inline]
    pub fn encode_into(&self, sender: u32, b: &mut [u8; HEADER_LEN]) {
        let words = self.words(sender);
        for (chunk, word) in b[..32].chunks_exact_mut(8).zip(words) {
            chunk.copy_from_slice(&word.to_le_bytes());
        }
        b[32..36].copy_from_slice(&checksum_words(words).to_le_bytes());
        b[36..40].fill(0);
    }

    /// Whether `b` is exactly the header `sender` encodes for this description: the receiver's
    /// check on the common path, without decoding (a mismatch is then decoded to report it).
    #[inline]
    pub fn is_encoded_in(&self, sender: u32, b: &[u8; HEADER_LEN]) -> bool {
        let words = self.words(sender);
        let tail = u64::from(checksum_words(words));
        words
            .into_iter()
            .chain([tail])
            .zip(b.chunks_exact(8))
            .all(|(word, chunk)| chunk.try_into().ok().map(u64::from_le_bytes) == Some(word))
    }

    /// The header's first 32 bytes as little-endian words.
    fn words(&self, sender: u32) -> [u64; 4] {
        [
            u64::from(u32::from_le_bytes(MAGIC))
                | u64::from(VERSION) << 32
                | u64::from(self.kind as u8) << 40
                | u64::from(self.dtype.code()) << 48
                | u64::from(self.redop.unwrap_or(NO_REDOP)) << 56,
            self.seq,
            self.count,
            u64::from(self.root) | u64::from(sender) << 32,
        ]
    }

    /// Decodes a header; returns the description and the sender's rank.
    #[inline]
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<(OpDesc, u32), HeaderError> {
        if b[0..4] != MAGIC {
            return Err(HeaderError::Magic);
        }
        if b[4] != VERSION {
            return Err(HeaderError::Version(b[4]));
        }
        let sum = u32::from_le_bytes([b[32], b[33], b[34], b[35]]);
        if sum != checksum(b) || b[36..40].iter().any(|&x| x != 0) {
            return Err(HeaderError::Checksum);
        }
        let kind = OpKind::from_code(b[5]).ok_or(HeaderError::Field("kind", b[5]))?;
        let dtype = DataType::from_code(b[6]).ok_or(HeaderError::Field("dtype", b[6]))?;
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        Ok((
            OpDesc {
                kind,
                seq: u64_at(8),
                dtype,
                count: u64_at(16),
                redop: (b[7] != NO_REDOP).then_some(b[7]),
                root: u32_at(24),
            },
            u32_at(28),
        ))
    }
}

/// A hash of the header's 32 bytes of fields, a 64-bit word at a time (bytes 36..40 are
/// reserved: zero, and checked as such): catches a stream that is out of step (bytes of data read as a
/// header) rather than deliberate forgery. Each round is a bijection of the running state, so a
/// change in any one word always changes the 64-bit state.
fn checksum(b: &[u8; HEADER_LEN]) -> u32 {
    let mut words = [0u64; 4];
    for (word, chunk) in words.iter_mut().zip(b[..32].chunks_exact(8)) {
        let mut w = [0u8; 8];
        w.copy_from_slice(chunk);
        *word = u64::from_le_bytes(w);
    }
    checksum_words(words)
}

/// The checksum of the header's first 32 bytes, read as four little-endian words.
fn checksum_words(words: [u64; 4]) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for word in words {
        h = (h ^ word).wrapping_mul(0x0000_0100_0000_01b3);
        h ^= h >> 29;
    }
    (h ^ (h >> 32)) as u32
}

/// 32-bit FNV-1a: a cheap, stable hash for checksums and fingerprints (not for security).
pub fn fnv1a32(bytes: impl IntoIterator<Item = u8>) -> u32 {
    bytes.into_iter().fold(0x811c_9dc5u32, |h, x| {
        (h ^ u32::from(x)).wrapping_mul(0x0100_0193)
    })
}

impl fmt::Display for OpDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Point-to-point headers carry a pair's bytes and a fingerprint of its message sizes
        // in the count and root fields.
        if self.kind == OpKind::SendRecv {
            return write!(
                f,
                "{} #{} ({} bytes; message sizes fingerprint {:08x})",
                self.kind, self.seq, self.count, self.root
            );
        }
        write!(
            f,
            "{} #{} ({} × {}",
            self.kind, self.seq, self.count, self.dtype
        )?;
        if let Some(code) = self.redop {
            let name = match code {
                0 => "sum",
                1 => "prod",
                2 => "min",
                3 => "max",
                4 => "avg",
                5 => "premulsum",
                _ => "?",
            };
            write!(f, ", {name}")?;
        }
        if self.root != NO_ROOT {
            write!(f, ", root {}", self.root)?;
        }
        f.write_str(")")
    }
}

/// A header that cannot be decoded: the stream is corrupt or out of step.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("bad magic (stream out of step or not a weftcc peer)")]
    Magic,
    #[error("unsupported header version {0}")]
    Version(u8),
    #[error("header checksum mismatch")]
    Checksum,
    #[error("unknown {0} code {1}")]
    Field(&'static str, u8),
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn send_recv_headers_say_bytes_and_fingerprint_not_a_type_and_root() {
        let d = OpDesc {
            kind: OpKind::SendRecv,
            seq: 3,
            dtype: DataType::Uint8,
            count: 4096,
            redop: None,
            root: 0xbd9f_0fc9,
        };
        assert_eq!(
            d.to_string(),
            "send/recv #3 (4096 bytes; message sizes fingerprint bd9f0fc9)"
        );
    }

    fn desc() -> impl Strategy<Value = OpDesc> {
        (
            0usize..OpKind::ALL.len(),
            any::<u64>(),
            0usize..DataType::ALL.len(),
            any::<u64>(),
            proptest::option::of(0u8..NO_REDOP),
            any::<u32>(),
        )
            .prop_map(|(k, seq, d, count, redop, root)| OpDesc {
                kind: OpKind::ALL[k],
                seq,
                dtype: DataType::ALL[d],
                count,
                redop,
                root,
            })
    }

    proptest! {
        #[test]
        fn round_trips(d in desc(), sender in any::<u32>()) {
            let (back, s) = OpDesc::decode(&d.encode(sender)).unwrap();
            prop_assert_eq!(back, d);
            prop_assert_eq!(s, sender);
        }

        #[test]
        fn is_encoded_in_agrees_with_decoding(
            d in desc(),
            other in desc(),
            sender in any::<u32>(),
            other_sender in any::<u32>(),
            same in any::<(bool, bool)>(),
            flip in (0usize..HEADER_LEN, any::<u8>()),
        ) {
            let encoded_by = if same.1 { sender } else { other_sender };
            let mut b = if same.0 { d } else { other }.encode(encoded_by);
            b[flip.0] ^= flip.1; // 0: unchanged
            let decoded_equal = OpDesc::decode(&b).ok() == Some((d, sender));
            prop_assert_eq!(d.is_encoded_in(sender, &b), decoded_equal);
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), HEADER_LEN)) {
            let mut b = [0u8; HEADER_LEN];
            b.copy_from_slice(&bytes);
            let _ = OpDesc::decode(&b);
        }

        #[test]
        fn any_flipped_byte_is_detected(d in desc(), i in 0usize..HEADER_LEN, x in 1u8..) {
            let mut b = d.encode(3);
            b[i] ^= x;
            // Either rejected, or (for the checksum bytes themselves) still rejected.
            prop_assert!(OpDesc::decode(&b).is_err());
        }
    }
}
