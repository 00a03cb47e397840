//! The one grammar of byte sizes: every size setting, and `weft perf -b/-e`.

/// A byte size that [`parse_size`] does not understand.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid size {0:?} (expected a number of bytes with an optional K, M, G or T suffix: 4194304, 512K, 4MiB, 1.5M)")]
pub struct InvalidSize(pub String);

/// Parses a byte size: `4194304`, `512K`, `4M`, `1G`, `1T` (powers of 1024, case-insensitive,
/// optionally followed by `B` or `iB`: `64KB`, `4MiB`), and fractions with a suffix (`1.5M`).
/// The one grammar of every size weftcc reads: `WEFT_BUFFSIZE` and friends, `weft perf -b/-e`.
pub fn parse_size(text: &str) -> std::result::Result<usize, InvalidSize> {
    let bad = || InvalidSize(text.to_string());
    let lower = text.trim().to_ascii_lowercase();
    let stripped = lower
        .strip_suffix("ib")
        .or_else(|| lower.strip_suffix('b'))
        .unwrap_or(&lower);
    let (digits, shift) = match stripped.chars().last() {
        Some('k') => (&stripped[..stripped.len() - 1], 10),
        Some('m') => (&stripped[..stripped.len() - 1], 20),
        Some('g') => (&stripped[..stripped.len() - 1], 30),
        Some('t') => (&stripped[..stripped.len() - 1], 40),
        _ => (stripped, 0),
    };
    let digits = digits.trim();
    if let Ok(n) = digits.parse::<usize>() {
        return n.checked_mul(1usize << shift).ok_or_else(bad);
    }
    let scale = (1u64 << shift) as f64;
    match digits.parse::<f64>() {
        // A fraction only with a suffix, and only if it fits.
        Ok(v) if shift > 0 && v.is_finite() && v >= 0.0 && v * scale < usize::MAX as f64 => {
            Ok((v * scale) as usize)
        }
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4194304").unwrap(), 4 << 20);
        assert_eq!(parse_size("512K").unwrap(), 512 << 10);
        assert_eq!(parse_size("4m").unwrap(), 4 << 20);
        assert_eq!(parse_size("4MiB").unwrap(), 4 << 20);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert!(parse_size("").is_err());
        assert!(parse_size("x").is_err());
        assert!(parse_size("99999999999999999999G").is_err());
        assert_eq!(parse_size("64KB"), Ok(64 << 10));
        assert_eq!(parse_size("8B"), Ok(8));
        assert_eq!(parse_size("2T"), Ok(2 << 40));
        assert_eq!(parse_size("1.5M"), Ok(3 << 19));
        assert!(parse_size("1.5").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("abc").is_err());
        assert!(parse_size("99999999999T").is_err());
    }
}
