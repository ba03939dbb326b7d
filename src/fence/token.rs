//! The vocabulary of fencing: tokens and the resources they protect.

use std::fmt;
use std::sync::Arc;

/// A fencing token: an unsigned 64-bit number that grows with every new lease on a resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct FenceToken(pub u64);

/// Why a presented token could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenParseError {
    #[error("a fencing token is 1 to 20 ASCII digits, got {len} bytes")]
    BadLength { len: usize },
    #[error("a fencing token is ASCII digits only")]
    NotDigits,
    #[error("a fencing token is at most 18446744073709551615")]
    TooLarge,
}

/// The longest decimal form of a u64.
const TOKEN_DIGITS_MAX: usize = 20;

impl FenceToken {
    /// Parses the wire form: 1 to 20 ASCII digits, at most `u64::MAX`. No sign, no spaces, no
    /// `0x`: anything a careless client could mean two ways is refused.
    pub fn parse(raw: &[u8]) -> Result<Self, TokenParseError> {
        if raw.is_empty() || raw.len() > TOKEN_DIGITS_MAX {
            return Err(TokenParseError::BadLength { len: raw.len() });
        }
        let mut value: u64 = 0;
        for &b in raw {
            if !b.is_ascii_digit() {
                return Err(TokenParseError::NotDigits);
            }
            value = value
                .checked_mul(10)
                .and_then(|v| v.checked_add(u64::from(b - b'0')))
                .ok_or(TokenParseError::TooLarge)?;
        }
        Ok(Self(value))
    }
}

impl fmt::Display for FenceToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The name of what one lease protects (`job:invoice-generation`, `reports/2026/`,
/// `bucket/key`). Cheap to clone: it is the key of the gate's map and of every store call.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ResourceKey(Arc<str>);

/// Resource names are bounded so one request cannot make the store hold megabytes per key.
pub const RESOURCE_BYTES_MAX: usize = 1024;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResourceKeyError {
    #[error("a resource name is 1 to {RESOURCE_BYTES_MAX} bytes, got {len}")]
    BadLength { len: usize },
    #[error("a resource name has no control characters")]
    ControlCharacter,
}

impl ResourceKey {
    pub fn new(name: &str) -> Result<Self, ResourceKeyError> {
        if name.is_empty() || name.len() > RESOURCE_BYTES_MAX {
            return Err(ResourceKeyError::BadLength { len: name.len() });
        }
        // Control characters are U+0000 to U+001F and U+007F to U+009F: the bytes are enough
        // for ASCII names, which a per-char decode costs several times as much to check.
        let ascii_control = |b: u8| b < 0x20 || b == 0x7f;
        if name.bytes().any(ascii_control) || (!name.is_ascii() && name.chars().any(char::is_control)) {
            return Err(ResourceKeyError::ControlCharacter);
        }
        Ok(Self(name.into()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ResourceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_full_u64_range() {
        assert_eq!(FenceToken::parse(b"0"), Ok(FenceToken(0)));
        assert_eq!(FenceToken::parse(b"00012"), Ok(FenceToken(12)));
        assert_eq!(FenceToken::parse(b"18446744073709551615"), Ok(FenceToken(u64::MAX)));
    }

    #[test]
    fn refuses_everything_a_client_could_mean_two_ways() {
        let too_long = "9".repeat(10_000);
        for raw in ["", "-1", "+1", " 12", "12 ", "0x10", "1e3", "1.0", "١٢", too_long.as_str()] {
            assert!(FenceToken::parse(raw.as_bytes()).is_err(), "{raw:?} must be refused");
        }
        assert_eq!(FenceToken::parse(b"18446744073709551616"), Err(TokenParseError::TooLarge));
        assert_eq!(FenceToken::parse(b"99999999999999999999"), Err(TokenParseError::TooLarge));
    }

    #[test]
    fn resource_names_are_bounded() {
        assert!(ResourceKey::new("job:invoices").is_ok());
        assert!(ResourceKey::new("").is_err());
        assert!(ResourceKey::new(&"r".repeat(RESOURCE_BYTES_MAX + 1)).is_err());
        assert!(ResourceKey::new("a\nb").is_err());
    }

    #[test]
    fn every_control_character_is_refused() {
        for c in ('\u{0}'..='\u{1f}').chain('\u{7f}'..='\u{9f}') {
            assert_eq!(ResourceKey::new(&format!("a{c}b")), Err(ResourceKeyError::ControlCharacter), "{c:?}");
        }
        for name in ["café/ü", "\u{a0}x", "日本/キー", "a\u{2028}b"] {
            assert!(ResourceKey::new(name).is_ok(), "{name:?}");
        }
    }
}
