//! The selftests' size syntax: [`parse_size`] (`512M`, `1G`, `4096`, ...) and
//! [`format_size`] for reports.

pub(crate) const KIB: u64 = 1 << 10;
pub(crate) const MIB: u64 = 1 << 20;
pub(crate) const GIB: u64 = 1 << 30;
const TIB: u64 = 1 << 40;

/// Accepted size syntax, quoted in [`SizeError`] messages.
const SIZE_SYNTAX: &str =
    "expected [0-9]+[kKmMgGtTbB]? in powers of 1024, optionally followed by `iB`/`B`, e.g. 4096, 512M, 1G, 1GiB";

/// Errors from [`parse_size`].
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SizeError {
    /// The input was empty (or only whitespace).
    #[error("empty size ({SIZE_SYNTAX})")]
    Empty,
    /// The input does not match the size syntax.
    #[error("invalid size `{0}` ({SIZE_SYNTAX})")]
    Invalid(String),
    /// The size is zero.
    #[error("size must be greater than zero ({SIZE_SYNTAX})")]
    Zero,
    /// The size does not fit in 64 bits.
    #[error("size `{0}` is too large (it overflows 64 bits)")]
    Overflow(String),
}

/// Parses a size in KVM selftests' syntax `[0-9]+[kKmMgGtTbB]?` (powers of
/// 1024; `b`/`B` means bytes), optionally followed by `iB` or `B` after a
/// `k`/`m`/`g`/`t` unit: `4096`, `2m`, `512M`, `1G`, `1GiB`, `64KB`.
/// Surrounding whitespace is ignored.
///
/// # Errors
///
/// [`SizeError::Empty`], [`SizeError::Invalid`] (e.g. `12Q`, `-1`, `1.5G`),
/// [`SizeError::Zero`] or [`SizeError::Overflow`].
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let input = s.trim();
    if input.is_empty() {
        return Err(SizeError::Empty);
    }
    let invalid = || SizeError::Invalid(input.to_owned());
    let digits_end = input
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(input.len());
    let (digits, suffix) = input.split_at(digits_end);
    if digits.is_empty() {
        return Err(invalid());
    }
    let mut chars = suffix.chars();
    let multiplier = match chars.next() {
        None | Some('b' | 'B') => 1,
        Some('k' | 'K') => KIB,
        Some('m' | 'M') => MIB,
        Some('g' | 'G') => GIB,
        Some('t' | 'T') => TIB,
        Some(_) => return Err(invalid()),
    };
    let rest = chars.as_str();
    let rest_ok = match rest {
        "" => true,
        "iB" | "B" => multiplier != 1,
        _ => false,
    };
    if !rest_ok {
        return Err(invalid());
    }
    let overflow = || SizeError::Overflow(input.to_owned());
    let mut value: u64 = 0;
    for d in digits.bytes() {
        value = value
            .checked_mul(10)
            .and_then(|v| v.checked_add(u64::from(d - b'0')))
            .ok_or_else(overflow)?;
    }
    let bytes = value.checked_mul(multiplier).ok_or_else(overflow)?;
    if bytes == 0 {
        return Err(SizeError::Zero);
    }
    Ok(bytes)
}

/// Formats a byte count with binary units: "123 B", "4 KiB", "512 MiB",
/// "1 GiB", "1.5 GiB" (up to two decimals, trailing zeros dropped).
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < KIB {
        return format!("{bytes} B");
    }
    let mut unit_idx = 0;
    let mut unit = KIB;
    while unit_idx + 1 < UNITS.len() && bytes / unit >= 1024 {
        unit *= 1024;
        unit_idx += 1;
    }
    let mut whole = bytes / unit;
    let rem = u128::from(bytes % unit);
    // Hundredths, rounded to nearest.
    let mut hundredths = (rem * 100 + u128::from(unit) / 2) / u128::from(unit);
    if hundredths >= 100 {
        whole += 1;
        hundredths = 0;
    }
    let unit_name = UNITS[unit_idx];
    if hundredths == 0 {
        format!("{whole} {unit_name}")
    } else if hundredths % 10 == 0 {
        format!("{whole}.{} {unit_name}", hundredths / 10)
    } else {
        format!("{whole}.{hundredths:02} {unit_name}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_size_good() {
        let cases: &[(&str, u64)] = &[
            ("4096", 4096),
            ("1", 1),
            ("2m", 2 * MIB),
            ("512M", 512 * MIB),
            ("1G", GIB),
            ("1g", GIB),
            ("1GiB", GIB),
            ("1GB", GIB),
            ("64k", 64 * KIB),
            ("64KiB", 64 * KIB),
            ("2T", 2 * TIB),
            ("100b", 100),
            ("100B", 100),
            ("007M", 7 * MIB),
            (" 8M\n", 8 * MIB),
        ];
        for &(input, want) in cases {
            assert_eq!(parse_size(input), Ok(want), "input {input:?}");
        }
        assert_eq!(parse_size("16777215T"), Ok(16_777_215 * TIB));
        assert_eq!(parse_size("18446744073709551615"), Ok(u64::MAX));
    }

    #[test]
    fn parse_size_bad() {
        assert_eq!(parse_size(""), Err(SizeError::Empty));
        assert_eq!(parse_size("   "), Err(SizeError::Empty));
        assert_eq!(parse_size("0"), Err(SizeError::Zero));
        assert_eq!(parse_size("0G"), Err(SizeError::Zero));
        for bad in [
            "12Q", "-1", "1.5G", "G", "1 G", "1Gi", "1GiBx", "1iB", "1bB", "1BiB", "+1", "0x10",
            "1e6", "١",
        ] {
            assert_eq!(
                parse_size(bad),
                Err(SizeError::Invalid(bad.to_owned())),
                "input {bad:?}"
            );
        }
        assert_eq!(
            parse_size("18446744073709551616"),
            Err(SizeError::Overflow("18446744073709551616".to_owned()))
        );
        assert_eq!(
            parse_size("16777216T"),
            Err(SizeError::Overflow("16777216T".to_owned()))
        );
        assert_eq!(
            parse_size("99999999999999999999999G"),
            Err(SizeError::Overflow("99999999999999999999999G".to_owned()))
        );
    }

    #[test]
    fn size_error_messages_name_input_and_syntax() {
        let msg = parse_size("12Q").unwrap_err().to_string();
        assert!(msg.contains("`12Q`"), "{msg}");
        assert!(msg.contains("[0-9]+[kKmMgGtTbB]?"), "{msg}");
        let msg = parse_size("").unwrap_err().to_string();
        assert!(msg.contains("[0-9]+[kKmMgGtTbB]?"), "{msg}");
        let msg = parse_size("0").unwrap_err().to_string();
        assert!(msg.contains("zero"), "{msg}");
        let msg = parse_size("99999999999999999999").unwrap_err().to_string();
        assert!(msg.contains("99999999999999999999"), "{msg}");
    }

    #[test]
    fn format_size_cases() {
        assert_eq!(format_size(0), "0 B");
        assert_eq!(format_size(123), "123 B");
        assert_eq!(format_size(1023), "1023 B");
        assert_eq!(format_size(4096), "4 KiB");
        assert_eq!(format_size(512 * MIB), "512 MiB");
        assert_eq!(format_size(GIB), "1 GiB");
        assert_eq!(format_size(GIB + GIB / 2), "1.5 GiB");
        assert_eq!(format_size(GIB + GIB / 4), "1.25 GiB");
        assert_eq!(format_size(2 * TIB), "2 TiB");
        assert_eq!(format_size(MIB - 1), "1024 KiB");
        assert_eq!(format_size(u64::MAX), "16 EiB");
    }

    #[test]
    fn parse_format_round_trip() {
        for s in ["4 KiB", "512 MiB", "1 GiB", "3 TiB"] {
            let compact: String = s.split_whitespace().collect();
            let bytes = parse_size(&compact).expect("valid size");
            assert_eq!(format_size(bytes), s);
        }
    }
}
