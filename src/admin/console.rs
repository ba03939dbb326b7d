//! The operator's console: one self-contained page (`console.html`: HTML, CSS and a little
//! JavaScript, nothing from another host), served at `GET /` of the admin listener. The page
//! holds no data: it reads the JSON endpoints beside it, with the admin token kept in an
//! `HttpOnly`, `SameSite=Strict` cookie (`POST /v1/session`).
//!
//! Its `Content-Security-Policy` allows exactly its own inline script and style (by their
//! SHA-256), connections to this listener only, and no framing: a resource name that were
//! ever rendered as markup could still run nothing.

use base64::Engine;
use bytes::Bytes;
use http::{StatusCode, header};
use sha2::{Digest, Sha256};

use super::{AdminResponse, full};

/// The page, as built into the binary.
pub const PAGE: &str = include_str!("console.html");

/// Every refusal fencegate answers (docs/errors.md), as built into the binary: the console links
/// each refusal's code to its row (`/errors#FencingTokenStale`).
const ERRORS: &str = include_str!("../../docs/errors.md");

/// `GET /errors`: docs/errors.md as a plain HTML page, each code's row anchored by its code.
/// No script, no style, nothing from another host.
pub fn errors_page() -> AdminResponse {
    static PAGE: std::sync::OnceLock<Bytes> = std::sync::OnceLock::new();
    let mut resp = full(StatusCode::OK, PAGE.get_or_init(|| Bytes::from(errors_html(ERRORS))).clone());
    let headers = resp.headers_mut();
    headers.insert(header::CONTENT_TYPE, "text/html; charset=utf-8".parse().expect("static"));
    headers
        .insert(header::CONTENT_SECURITY_POLICY, "default-src 'none'; frame-ancestors 'none'".parse().expect("static"));
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, "nosniff".parse().expect("static"));
    resp
}

/// The page's HTML: headings, paragraphs and tables, every text escaped; the first table row
/// whose second cell is a code (`` `Code` ``) gets that code as its `id`.
fn errors_html(markdown: &str) -> String {
    let mut anchored = std::collections::HashSet::new();
    let mut html = String::from(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>fencegate errors</title></head><body>\n",
    );
    let mut in_table = false;
    for line in markdown.lines() {
        let line = line.trim_end();
        if let Some(cells) = line.strip_prefix('|').and_then(|l| l.strip_suffix('|')) {
            let cells: Vec<&str> = cells.split('|').map(str::trim).collect();
            if cells.iter().all(|c| c.chars().all(|ch| ch == '-' || ch == ':')) {
                continue; // the header's rule
            }
            let (tag, open) = if in_table { ("td", String::new()) } else { ("th", "<table>\n".to_owned()) };
            in_table = true;
            let id = cells.get(1).and_then(|c| c.strip_prefix('`')?.strip_suffix('`'));
            html.push_str(&open);
            match id.filter(|id| id.chars().all(|c| c.is_ascii_alphanumeric()) && anchored.insert(*id)) {
                Some(id) => html.push_str(&format!("<tr id=\"{id}\">")),
                None => html.push_str("<tr>"),
            }
            for cell in cells {
                html.push_str(&format!("<{tag}>{}</{tag}>", escaped(cell)));
            }
            html.push_str("</tr>\n");
            continue;
        }
        if in_table {
            html.push_str("</table>\n");
            in_table = false;
        }
        if let Some(title) = line.strip_prefix("## ") {
            html.push_str(&format!("<h2>{}</h2>\n", escaped(title)));
        } else if let Some(title) = line.strip_prefix("# ") {
            html.push_str(&format!("<h1>{}</h1>\n", escaped(title)));
        } else if !line.is_empty() {
            html.push_str(&format!("<p>{}</p>\n", escaped(line)));
        }
    }
    if in_table {
        html.push_str("</table>\n");
    }
    html.push_str("</body></html>\n");
    html
}

fn escaped(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

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

    /// Each code of docs/errors.md has its anchor, and no text of the page is markup.
    #[test]
    fn the_errors_page_anchors_each_code_and_escapes_the_rest() {
        let html = errors_html(ERRORS);
        for code in ["FencingTokenStale", "FencingTokenRequired", "InvalidFencingToken", "SlowDown", "AccessDenied"] {
            assert!(html.contains(&format!("<tr id=\"{code}\">")), "{code}");
        }
        assert_eq!(html.matches("<tr id=\"FenceStoreUnavailable\">").count(), 1, "one anchor per code");
        let hostile = errors_html("| 400 | `X` | a <script>alert(1)</script> & \"q\" | y |\n");
        assert!(
            hostile.contains("<tr id=\"X\">") && hostile.contains("&lt;script&gt;") && !hostile.contains("<script>")
        );
    }
}
