//! Percent-decoding of URL paths, shared by every listener.

use std::borrow::Cow;

/// Decodes `%XX` escapes; `None` for a broken escape or a result that is not UTF-8. A `+` is
/// a plus sign (paths are not form-encoded).
pub fn decode(raw: &str) -> Option<Cow<'_, str>> {
    let bytes = raw.as_bytes();
    if !bytes.contains(&b'%') {
        // Most paths: nothing to decode, nothing to copy.
        return Some(Cow::Borrowed(raw));
    }
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            // Two hex digits, nothing else (`from_str_radix` alone also takes a sign: `%+f`).
            let hex = bytes.get(i + 1..i + 3)?;
            if !hex.iter().all(u8::is_ascii_hexdigit) {
                return None;
            }
            out.push(u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok().map(Cow::Owned)
}

/// Encodes an object key for a path: every byte but unreserved characters and `/` escaped.
pub fn encode_key(key: &str) -> String {
    const KEY: &percent_encoding::AsciiSet =
        &percent_encoding::NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~').remove(b'/');
    percent_encoding::utf8_percent_encode(key, KEY).to_string()
}

#[cfg(test)]
mod tests {
    use super::{decode, encode_key};

    #[test]
    fn keys_round_trip() {
        for key in ["a b/c+d", "€/x", "100%/y?z#w", "plain/key.txt"] {
            assert_eq!(decode(&encode_key(key)).as_deref(), Some(key));
        }
        assert_eq!(encode_key("a b/c"), "a%20b/c");
    }

    #[test]
    fn an_escape_is_two_hex_digits() {
        assert_eq!(decode("a%2Fb%2fc").as_deref(), Some("a/b/c"));
        for broken in ["%+f", "%-f", "% f", "%zz", "%4", "%", "a%+0"] {
            assert_eq!(decode(broken), None, "{broken}");
        }
    }

    #[test]
    fn decodes_escapes_and_refuses_broken_ones() {
        assert_eq!(decode("a%20b%2Fc+d").as_deref(), Some("a b/c+d"));
        assert_eq!(decode("%e2%82%ac").as_deref(), Some("€"));
        for bad in ["%", "%2", "%zz", "%ff"] {
            assert_eq!(decode(bad), None, "{bad}");
        }
    }
}
