//! One `[[routes]]` entry, compiled: which paths it takes, the resource a write belongs to, and
//! the URL a request goes to.

use std::sync::Arc;
use std::time::Duration;

use crate::config::{RouteConfig, RouteMode, ms};
use crate::fence::ResourceKey;
use crate::refusal::Refusal;

use super::client::ApiClient;
use super::error::GatewayError;

pub struct Route {
    /// Path prefix on fencegate's listener, with both slashes (`/payments/`).
    pub prefix: String,
    /// The upstream base URL without its trailing slash; the rest of the path follows it.
    base: String,
    template: Template,
    pub mode: RouteMode,
    pub client: Arc<ApiClient>,
    /// From sending a request upstream until its response head.
    pub request_timeout: Duration,
    /// Largest request body forwarded (and, in `idempotency-key` mode, buffered and hashed).
    pub body_bytes_max: usize,
    /// Largest response recorded for replay.
    pub response_bytes_max: usize,
    /// How long idempotency records are kept.
    pub retention_ms: u64,
    /// Whether a write through this route may raise a fence (`routes.advance`).
    pub writes_advance: bool,
    /// Bytes of request bodies this route may hold at once (`routes.buffered_bytes_max`).
    pub buffered: Arc<tokio::sync::Semaphore>,
    /// What each caller holds of `buffered`, and the most one may: a quarter of it (at least
    /// one body), so that one caller's slow bodies cannot take the route from the others.
    pub buffered_by_caller: Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>,
    pub caller_buffered_max: usize,
    /// The headers naming the caller (`routes.caller_header` and `routes.caller_headers`).
    pub caller_headers: Vec<http::HeaderName>,
}

impl Route {
    pub fn new(config: &RouteConfig, client: Arc<ApiClient>) -> Result<Self, String> {
        Ok(Self {
            prefix: config.prefix.clone(),
            base: config.upstream.trim_end_matches('/').to_owned(),
            template: Template::parse(&config.resource)?,
            mode: config.mode,
            client,
            request_timeout: ms(config.request_timeout_ms),
            body_bytes_max: config.body_bytes_max,
            response_bytes_max: config.response_bytes_max,
            retention_ms: config.idempotency_retention_ms,
            writes_advance: config.advance.writes_advance(),
            buffered: Arc::new(tokio::sync::Semaphore::new(config.buffered_bytes_max)),
            buffered_by_caller: Arc::default(),
            caller_buffered_max: (config.buffered_bytes_max / 4).max(config.body_bytes_max),
            caller_headers: std::iter::once(&config.caller_header)
                .chain(&config.caller_headers)
                .map(|name| {
                    http::HeaderName::from_bytes(name.as_bytes())
                        .map_err(|e| format!("routes.caller_headers {name:?}: {e}"))
                })
                .collect::<Result<Vec<_>, _>>()?,
        })
    }

    /// Who is calling, for the idempotency record's key and the caller's share of the route's
    /// buffer: a hash of the values of every caller header, each named (absent ones alike:
    /// every caller without them shares one scope).
    pub fn caller(&self, headers: &http::HeaderMap) -> String {
        use sha2::Digest;
        let mut hash = sha2::Sha256::new();
        for name in &self.caller_headers {
            hash.update(name.as_str().as_bytes());
            for value in headers.get_all(name) {
                hash.update(b"\0");
                hash.update((value.len() as u64).to_be_bytes());
                hash.update(value.as_bytes());
            }
            hash.update(b"\n");
        }
        hex::encode(hash.finalize())
    }

    /// Holds `bytes` of the route's buffer for `caller`, within the caller's share; `None`
    /// when the route or the caller has none left.
    pub fn hold_buffer(&self, caller: &str, bytes: usize) -> Option<BufferHold> {
        let bytes_u32 = u32::try_from(bytes).unwrap_or(u32::MAX);
        {
            let mut by_caller = self.buffered_by_caller.lock().expect("buffer lock");
            let held = by_caller.entry(caller.to_owned()).or_default();
            if *held + bytes > self.caller_buffered_max {
                if *held == 0 {
                    by_caller.remove(caller);
                }
                return None;
            }
            *held += bytes;
        }
        // Given back by the hold's drop if the route's own buffer is full.
        let mut hold =
            BufferHold { by_caller: self.buffered_by_caller.clone(), caller: caller.to_owned(), bytes, permit: None };
        hold.permit = Some(self.buffered.clone().try_acquire_many_owned(bytes_u32).ok()?);
        Some(hold)
    }

    pub fn mode_name(&self) -> &'static str {
        match self.mode {
            RouteMode::IdempotencyKey => "idempotency-key",
            RouteMode::Conditional => "conditional",
            RouteMode::FenceOnly => "fence-only",
        }
    }

    /// The path after the prefix, once checked: no segment may be (or percent-decode to) a
    /// dot segment, which would let a request climb out of the upstream base.
    pub fn rest<'p>(&self, path: &'p str) -> Result<&'p str, GatewayError> {
        let rest = path.strip_prefix(self.prefix.as_str()).ok_or(GatewayError::UnsafePath)?;
        for segment in rest.split('/') {
            let decoded = crate::net::percent::decode(segment).ok_or(GatewayError::UnsafePath)?;
            if decoded.split(['/', '\\']).any(|part| part == "." || part == "..") {
                return Err(GatewayError::UnsafePath);
            }
        }
        Ok(rest)
    }

    /// The upstream URL of `rest` (from [`Route::rest`]) and the client's query.
    pub fn upstream_uri(&self, rest: &str, query: Option<&str>) -> Result<http::Uri, GatewayError> {
        let uri = match query {
            Some(q) => format!("{}/{rest}?{q}", self.base),
            None => format!("{}/{rest}", self.base),
        };
        uri.parse().map_err(|_| GatewayError::UnsafePath)
    }

    /// The resource a write to `rest` belongs to. Segments are percent-decoded first, so that
    /// `/payments/42` and `/payments/%34%32` (the same payment to the API) are one resource.
    pub fn resource(&self, rest: &str) -> Result<ResourceKey, GatewayError> {
        let segments: Vec<&str> = rest.split('/').collect();
        let name = self.template.render(&segments)?;
        Ok(ResourceKey::new(&name).map_err(Refusal::InvalidResource)?)
    }
}

/// Bytes of a route's buffer held for one caller, given back when dropped.
pub struct BufferHold {
    by_caller: Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>,
    caller: String,
    bytes: usize,
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Drop for BufferHold {
    fn drop(&mut self) {
        let mut by_caller = self.by_caller.lock().expect("buffer lock");
        if let Some(held) = by_caller.get_mut(&self.caller) {
            *held = held.saturating_sub(self.bytes);
            if *held == 0 {
                by_caller.remove(&self.caller);
            }
        }
    }
}

/// A resource template: literal text and `{n}` placeholders (the n-th path segment after the
/// prefix, from 1).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Template(Vec<Part>);

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Literal(String),
    Segment(usize),
}

impl Template {
    fn parse(text: &str) -> Result<Self, String> {
        let mut parts = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            match rest.find(['{', '}']) {
                None => {
                    parts.push(Part::Literal(rest.to_owned()));
                    break;
                }
                Some(i) if rest.as_bytes()[i] == b'}' => return Err(format!("{text:?}: a '}}' without its '{{'")),
                Some(i) => {
                    if i > 0 {
                        parts.push(Part::Literal(rest[..i].to_owned()));
                    }
                    let close = rest[i..].find('}').ok_or_else(|| format!("{text:?}: a '{{' without its '}}'"))?;
                    let inside = &rest[i + 1..i + close];
                    let n: usize = inside
                        .parse()
                        .ok()
                        .filter(|n| *n >= 1)
                        .ok_or_else(|| format!("{text:?}: placeholders are {{1}}, {{2}}, ..., got {{{inside}}}"))?;
                    parts.push(Part::Segment(n));
                    rest = &rest[i + close + 1..];
                }
            }
        }
        if parts.is_empty() {
            return Err("must not be empty".into());
        }
        Ok(Self(parts))
    }

    fn render(&self, segments: &[&str]) -> Result<String, GatewayError> {
        let mut out = String::new();
        for part in &self.0 {
            match part {
                Part::Literal(text) => out.push_str(text),
                Part::Segment(n) => {
                    let raw = segments.get(n - 1).filter(|s| !s.is_empty()).ok_or(GatewayError::MissingSegment(*n))?;
                    out.push_str(&crate::net::percent::decode(raw).ok_or(GatewayError::UnsafePath)?);
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RouteMode;

    fn route(prefix: &str, upstream: &str, resource: &str) -> Route {
        let config = RouteConfig {
            prefix: prefix.into(),
            upstream: upstream.into(),
            resource: resource.into(),
            mode: RouteMode::FenceOnly,
            advance: crate::config::AdvancePolicy::Registration,
            idempotency_retention_ms: 1,
            request_timeout_ms: 1,
            body_bytes_max: 1,
            response_bytes_max: 1,
            buffered_bytes_max: 1,
            caller_header: "authorization".into(),
            caller_headers: vec![],
            ca_cert_path: None,
        };
        Route::new(&config, Arc::new(ApiClient::new(None, Duration::from_secs(1), 1, 1).unwrap())).unwrap()
    }

    /// `{n}` takes the n-th segment after the prefix, percent-decoded; a missing one is an error.
    #[test]
    fn templates_take_path_segments() {
        let r = route("/payments/", "https://api.example.com/v1/payments/", "payment:{1}");
        assert_eq!(r.resource("42").unwrap().as_str(), "payment:42");
        assert_eq!(r.resource("42/capture").unwrap().as_str(), "payment:42");
        assert_eq!(r.resource("%34%32").unwrap().as_str(), "payment:42");
        assert!(matches!(r.resource(""), Err(GatewayError::MissingSegment(1))));
        let r = route("/t/", "http://h/", "{2}@{1}-x");
        assert_eq!(r.resource("a/b/c").unwrap().as_str(), "b@a-x");
        assert!(matches!(r.resource("a"), Err(GatewayError::MissingSegment(2))));
        assert_eq!(route("/t/", "http://h/", "all-of-it").resource("").unwrap().as_str(), "all-of-it");
    }

    #[test]
    fn broken_templates_are_refused() {
        for bad in ["{0}", "{x}", "a{1", "a}1", "{}", ""] {
            assert!(Template::parse(bad).is_err(), "{bad:?}");
        }
    }

    /// The rest of the path is appended to the upstream base; dot segments, encoded or not, are
    /// refused so a request cannot leave the base.
    #[test]
    fn upstream_urls_stay_under_the_base() {
        let r = route("/payments/", "https://api.example.com/v1/payments/", "payment:{1}");
        let rest = r.rest("/payments/42/capture").unwrap();
        assert_eq!(r.upstream_uri(rest, Some("a=1")).unwrap(), "https://api.example.com/v1/payments/42/capture?a=1");
        assert_eq!(
            r.upstream_uri(r.rest("/payments/").unwrap(), None).unwrap(),
            "https://api.example.com/v1/payments/"
        );
        for bad in
            ["/payments/../admin", "/payments/42/%2e%2E/x", "/payments/.", "/payments/a%2F..%2Fb", "/payments/%zz"]
        {
            assert!(matches!(r.rest(bad), Err(GatewayError::UnsafePath)), "{bad}");
        }
    }
}
