//! `fencegate reconcile`: asks a running fencegate (its admin listener, as the config names
//! it) to compare its upstream with its fences (`POST /v1/reconcile`, `upkeep::reconcile`), shows
//! what it finds as it finds it, and exits non-zero when it found anything, so that cron and
//! CI can run it.

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::Value;

use crate::config::Config;
use crate::jobs::{Action, Event, Finding, Summary};

/// What the command was asked.
pub struct Ask {
    pub bucket: Option<String>,
    pub prefix: String,
    /// The kinds of findings to fix.
    pub apply: Vec<crate::jobs::ApplyKind>,
    /// JSON lines on stdout (one per finding, then the summary) instead of a table.
    pub json: bool,
    /// `Job::old_upload_after_ms`, when asked (else the server's default, and the request reads
    /// as it did before the field existed).
    pub old_upload_after_ms: Option<u64>,
}

/// How a reconciliation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Clean,
    Found,
}

/// Runs one reconciliation against the fencegate `config` describes.
pub async fn reconcile(config: &Config, ask: &Ask) -> anyhow::Result<Outcome> {
    let admin = reachable(config.server.admin_listen);
    let stream = tokio::net::TcpStream::connect(admin).await.with_context(|| {
        format!("cannot reach fencegate's admin listener at {admin} (server.admin_listen): is it running?")
    })?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    if ask.apply.contains(&crate::jobs::ApplyKind::RaiseFence) {
        eprintln!(
            "fencegate reconcile: raising fences to objects' stamps: a stamp is not authenticated, whoever can \
             write the upstream directly can forge one (and lock a resource's older tokens out)"
        );
    }
    // Nothing to apply is sent as `false`, which a fencegate of any version reads.
    let apply = if ask.apply.is_empty() { serde_json::json!(false) } else { serde_json::json!(ask.apply) };
    let mut body = serde_json::json!({ "bucket": ask.bucket, "prefix": ask.prefix, "apply": apply });
    if let Some(ms) = ask.old_upload_after_ms {
        body["old_upload_after_ms"] = ms.into();
    }
    let mut req = http::Request::post("/v1/reconcile")
        .header(http::header::HOST, admin.to_string())
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())))?;
    if let Some(token) = &config.server.admin_token {
        let value = http::HeaderValue::from_str(&format!("Bearer {}", token.expose()))
            .context("server.admin_token is not a header value")?;
        req.headers_mut().insert(http::header::AUTHORIZATION, value);
    }
    let resp = sender.send_request(req).await.context("the reconcile request failed")?;
    let status = resp.status();
    let mut body = resp.into_body();
    if !status.is_success() {
        let text = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        let detail: Value = serde_json::from_slice(&text).unwrap_or(Value::Null);
        anyhow::bail!("fencegate answered {status}: {}", detail["detail"].as_str().unwrap_or("(no detail)"));
    }
    let mut out = Output::new(ask.json);
    let mut pending = Vec::new();
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.context("the reconcile answer broke off")?.into_data() else { continue };
        pending.extend_from_slice(&data);
        while let Some(end) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            if let Some(outcome) = out.event(&line)? {
                return Ok(outcome);
            }
        }
    }
    anyhow::bail!("the reconcile answer ended before its summary")
}

/// The admin listener as a client on this host reaches it (`fencegate health`, `reconcile`): an
/// unspecified address is this host's loopback.
pub fn reachable(listen: SocketAddr) -> SocketAddr {
    match listen.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(Ipv4Addr::LOCALHOST.into(), listen.port()),
        IpAddr::V6(ip) if ip.is_unspecified() => SocketAddr::new(Ipv6Addr::LOCALHOST.into(), listen.port()),
        _ => listen,
    }
}

/// Findings as a table for people or JSON lines for scripts; progress on stderr.
struct Output {
    json: bool,
    header_shown: bool,
    /// Findings received: the outcome is "found" if any came, whatever the summary says.
    found: u64,
}

/// A finding as a line of the table.
struct Row<'a> {
    kind: &'static str,
    key: &'a str,
    resource: &'a str,
    token: Option<u64>,
    fence: Option<u64>,
    /// An upload's id and creation, an object's time, a record's claim.
    detail: String,
    action: String,
}

impl Output {
    fn new(json: bool) -> Self {
        Self { json, header_shown: false, found: 0 }
    }

    /// Shows one event (`line`, as fencegate sent it); the outcome once the scan ended.
    fn event(&mut self, line: &[u8]) -> anyhow::Result<Option<Outcome>> {
        let mut stdout = std::io::stdout().lock();
        let event: Event = match serde_json::from_slice(line) {
            Ok(event) => event,
            Err(error) => return self.unknown(&mut stdout, line, &error).map(|()| None),
        };
        match event {
            Event::Progress { records, objects, uploads } => {
                eprintln!("scanned {records} gateway records, {uploads} uploads, {objects} objects");
            }
            Event::Finding(finding) => {
                self.found += 1;
                match self.json {
                    true => stdout.write_all(line)?,
                    false => self.finding(&mut stdout, &finding)?,
                }
            }
            Event::Done(summary) => {
                if self.json {
                    stdout.write_all(line)?;
                } else {
                    done(&mut stdout, &summary)?;
                }
                let found = summary.findings > 0 || self.found > 0;
                return Ok(Some(if found { Outcome::Found } else { Outcome::Clean }));
            }
            Event::Failed { error } => anyhow::bail!("the reconciliation failed: {error}"),
        }
        Ok(None)
    }

    /// A line this command cannot read as an event (a fencegate of another version): a finding
    /// of a kind it does not know is passed on as sent (`--json`) or named on stderr, and
    /// counts as found; anything else ends the command.
    fn unknown(&mut self, stdout: &mut impl Write, line: &[u8], error: &serde_json::Error) -> anyhow::Result<()> {
        let value: Value = serde_json::from_slice(line).context("fencegate sent a line that is not JSON")?;
        if value["event"] != "finding" {
            anyhow::bail!("fencegate sent an event this command cannot read ({error}): {}", shown(&value.to_string()));
        }
        self.found += 1;
        if self.json {
            stdout.write_all(line)?;
        } else {
            eprintln!(
                "fencegate reconcile: a finding this command cannot show ({error}): {}",
                shown(&value.to_string())
            );
        }
        Ok(())
    }

    /// One finding, as a line of the table (its header first).
    fn finding(&mut self, stdout: &mut impl Write, finding: &Finding) -> anyhow::Result<()> {
        if !self.header_shown {
            writeln!(
                stdout,
                "{:<20} {:<52} {:<30} {:>8} {:>8}  {:<40}  ACTION",
                "FINDING", "KEY", "RESOURCE", "TOKEN", "FENCE", "UPLOAD OR OBJECT TIME"
            )?;
            self.header_shown = true;
        }
        let row = row(finding);
        let show = |v: Option<u64>| v.map_or("-".to_owned(), |n| n.to_string());
        writeln!(
            stdout,
            "{:<20} {:<52} {:<30} {:>8} {:>8}  {:<40}  {}",
            row.kind,
            shown(row.key),
            shown(row.resource),
            show(row.token),
            show(row.fence),
            shown(&row.detail),
            shown(&row.action),
        )?;
        Ok(())
    }
}

/// What the table shows of a finding. A gateway record's key is the one the API was sent, to
/// look it up there.
fn row(finding: &Finding) -> Row<'_> {
    let row = |kind, key, resource, token, fence| Row {
        kind,
        key,
        resource,
        token,
        fence,
        detail: String::new(),
        action: "-".to_owned(),
    };
    match finding {
        Finding::StaleUpload { key, upload_id, resource, token, fence, created_at_ms, action } => Row {
            detail: upload(upload_id, *created_at_ms),
            action: applied(action),
            ..row("stale_upload", key, resource, Some(*token), Some(*fence))
        },
        Finding::OldUpload { key, upload_id, resource, token, created_at_ms } => {
            Row { detail: upload(upload_id, *created_at_ms), ..row("old_upload", key, resource, Some(*token), None) }
        }
        Finding::Unstamped { key, resource, fence, modified } => {
            Row { detail: modified_at(modified.as_deref()), ..row("unstamped", key, resource, None, *fence) }
        }
        Finding::StampAboveFence { key, resource, stamp, fence, modified, action } => Row {
            detail: modified_at(modified.as_deref()),
            action: applied(action),
            ..row("stamp_above_fence", key, resource, Some(*stamp), *fence)
        },
        Finding::UnknownOutcome { resource, route, upstream_key, token, fence, cause, claimed_at_ms, .. } => Row {
            detail: when(*claimed_at_ms).map(|t| format!("claimed {t}")).unwrap_or_default(),
            action: format!("ask the API ({}) behind {route}", cause_name(*cause)),
            ..row("unknown_outcome", upstream_key, resource, Some(*token), *fence)
        },
        Finding::UnreadableRecord { name, error } => {
            Row { action: format!("unreadable: {error}"), ..row("unreadable_record", name, "", None, None) }
        }
    }
}

/// The summary, as a sentence or two.
fn done(stdout: &mut impl Write, summary: &Summary) -> anyhow::Result<()> {
    let Summary { records, objects, uploads, findings, applied, unattributed, in_flight } = summary;
    writeln!(
        stdout,
        "{findings} found in {records} gateway records, {uploads} uploads and {objects} objects; {applied} applied"
    )?;
    if *unattributed > 0 {
        writeln!(
            stdout,
            "{unattributed} stamped objects outside every rule: their writers named their resource, which an \
             object does not record, so their stamps are not judged (add a [[fencing.rules]] entry \
             for their prefix to have them checked)"
        )?;
    }
    if *in_flight > 0 {
        writeln!(
            stdout,
            "{in_flight} gateway requests still within their claim's window: run again once it closed to know their outcome"
        )?;
    }
    Ok(())
}

/// An upload's id and when it was created.
fn upload(id: &str, created_at_ms: u64) -> String {
    match when(created_at_ms) {
        Some(created) => format!("{id} created {created}"),
        None => id.to_owned(),
    }
}

fn modified_at(modified: Option<&str>) -> String {
    modified.map(|m| format!("modified {m}")).unwrap_or_default()
}

/// A wall-clock time in ms as RFC 3339 (to the second); `None` for 0 (not kept).
fn when(ms: u64) -> Option<String> {
    let at = time::OffsetDateTime::from_unix_timestamp(i64::try_from(ms / 1000).ok().filter(|s| *s > 0)?).ok()?;
    at.format(&time::format_description::well_known::Rfc3339).ok()
}

fn applied(action: &Action) -> String {
    match action {
        Action::None => "-".into(),
        Action::Aborted => "aborted".into(),
        Action::Raised => "raised".into(),
        Action::Failed(error) => format!("failed: {error}"),
    }
}

fn cause_name(cause: crate::fence::AmbiguousCause) -> String {
    serde_json::to_value(cause).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_else(|| "?".into())
}

/// A name as the terminal shows it: control and format characters escaped (a key can hold
/// any), so that no key moves the cursor, retitles the window or reorders the line around it
/// (bidirectional overrides).
fn shown(name: &str) -> String {
    name.chars().map(|c| if prints(c) { c.to_string() } else { c.escape_unicode().to_string() }).collect()
}

/// Whether `c` shows as itself: not a control, not a space other than U+0020, not one of
/// Unicode's format characters nor its default-ignorable code points (bidirectional marks and
/// overrides, zero-width characters, the soft hyphen, variation selectors, Hangul fillers,
/// tags: they reorder a line or make two names look alike), not a private-use character nor a
/// noncharacter. The console escapes the same set (console.html, `INVISIBLE`).
fn prints(c: char) -> bool {
    let hidden = c.is_control()
        || (c.is_whitespace() && c != ' ')
        || matches!(c,
            // Default_Ignorable_Code_Point (Unicode 15.1)
            '\u{00AD}' | '\u{034F}' | '\u{061C}' | '\u{115F}'..='\u{1160}' | '\u{17B4}'..='\u{17B5}'
            | '\u{180B}'..='\u{180F}' | '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2060}'..='\u{206F}'
            | '\u{3164}' | '\u{FE00}'..='\u{FE0F}' | '\u{FEFF}' | '\u{FFA0}' | '\u{FFF0}'..='\u{FFF8}'
            | '\u{1BCA0}'..='\u{1BCA3}' | '\u{1D173}'..='\u{1D17A}' | '\u{E0000}'..='\u{E0FFF}'
            // the other format characters (Cf)
            | '\u{0600}'..='\u{0605}' | '\u{06DD}' | '\u{070F}' | '\u{0890}'..='\u{0891}' | '\u{08E2}'
            | '\u{FFF9}'..='\u{FFFB}' | '\u{110BD}' | '\u{110CD}' | '\u{13430}'..='\u{1343F}'
            // private use, and noncharacters
            | '\u{E000}'..='\u{F8FF}' | '\u{F0000}'..='\u{10FFFF}' | '\u{FDD0}'..='\u{FDEF}')
        || (c as u32 & 0xFFFE) == 0xFFFE;
    !hidden
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Control and bidirectional characters are shown escaped; the rest as they are.
    #[test]
    fn names_cannot_rewrite_the_terminal() {
        assert_eq!(shown("a\u{1b}[31mb"), "a\\u{1b}[31mb");
        assert_eq!(shown("pay\u{202e}nem"), "pay\\u{202e}nem");
        assert_eq!(shown("zero\u{200b}width"), "zero\\u{200b}width");
        assert_eq!(shown("été/報告.csv"), "été/報告.csv");
        // Look-alikes: a soft hyphen, a variation selector, a Hangul filler, a no-break space,
        // a tag character.
        for (name, escaped) in [
            ("in\u{ad}voice", "in\\u{ad}voice"),
            ("job\u{fe0f}", "job\\u{fe0f}"),
            ("a\u{3164}b", "a\\u{3164}b"),
            ("a\u{a0}b", "a\\u{a0}b"),
            ("a\u{e0041}", "a\\u{e0041}"),
            ("a\u{034f}b", "a\\u{34f}b"),
        ] {
            assert_eq!(shown(name), escaped);
        }
        assert_eq!(shown("a b"), "a b");
    }

    /// A finding of a kind this command does not know (a newer fencegate's) is passed on and
    /// counts as found; an unknown event of another sort ends the command.
    #[test]
    fn an_unknown_finding_is_passed_on_and_counted() {
        let line = br#"{"event":"finding","kind":"from_the_future","key":"k"}
"#;
        let error = serde_json::from_slice::<Event>(line).unwrap_err();
        let mut json = Output::new(true);
        let mut out = Vec::new();
        json.unknown(&mut out, line, &error).unwrap();
        assert_eq!((out.as_slice(), json.found), (&line[..], 1));
        let mut table = Output::new(false);
        let mut out = Vec::new();
        table.unknown(&mut out, line, &error).unwrap();
        assert!(out.is_empty() && table.found == 1, "named on stderr, not in the table");
        let other = br#"{"event":"from_the_future"}"#;
        let error = serde_json::from_slice::<Event>(other).unwrap_err();
        assert!(Output::new(true).unknown(&mut Vec::new(), other, &error).is_err());
    }
}
