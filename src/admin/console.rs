//! The operator's console: one self-contained page (`console.html`: HTML, CSS and a little
//! JavaScript, nothing from another host), served at `GET /` of the admin listener. The page
//! holds no data: it reads the JSON endpoints beside it, with the admin token kept in an
//! `HttpOnly`, `SameSite=Strict` cookie (`POST /v1/session`).
//!
//! Its `Content-Security-Policy` allows exactly its own inline script and style (by their
//! SHA-256), connections to this listener only, and no framing: a resource name that were
//! ever rendered as markup could still run nothing.

use base64::Engine;
use sha2::{Digest, Sha256};

/// The page, as built into the binary.
pub const PAGE: &str = include_str!("console.html");

/// The policy the page is served with.
pub fn content_security_policy() -> String {
    let hash = |tag: &str| {
        let body = inline(PAGE, tag).unwrap_or_default();
        base64::engine::general_purpose::STANDARD.encode(Sha256::digest(body.as_bytes()))
    };
    format!(
        "default-src 'none'; script-src 'sha256-{}'; style-src 'sha256-{}'; connect-src 'self'; img-src data:; \
         form-action 'none'; base-uri 'none'; frame-ancestors 'none'",
        hash("script"),
        hash("style")
    )
}

/// The text between the page's first `<tag>` and `</tag>`.
fn inline<'a>(page: &'a str, tag: &str) -> Option<&'a str> {
    let open = format!("<{tag}>");
    let start = page.find(&open)? + open.len();
    let end = start + page[start..].find(&format!("</{tag}>"))?;
    Some(&page[start..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The policy names the page's own script and style: a page edited without its policy
    /// following would be blocked in the browser (and the console test fails on a block).
    #[test]
    fn the_policy_covers_the_pages_own_script_and_style_only() {
        let script = inline(PAGE, "script").expect("the page has a script");
        let style = inline(PAGE, "style").expect("the page has a style");
        assert!(script.contains("EventSource") && style.contains('{'));
        assert_eq!(PAGE.matches("<script").count(), 1, "one inline script, hashed");
        assert_eq!(PAGE.matches("<style").count(), 1, "one inline style, hashed");
        let policy = content_security_policy();
        assert!(policy.starts_with("default-src 'none'; script-src 'sha256-"), "{policy}");
        assert!(!PAGE.contains("http://") && !PAGE.contains("https://"), "nothing from another host");
    }
}
