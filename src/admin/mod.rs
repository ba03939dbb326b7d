//! The admin listener: health, readiness, metrics, and the fences themselves
//! (`GET`/`PUT /v1/fences/{resource}`, G7). Errors are `application/problem+json`.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Deserialize;

use crate::fence::{AdmitError, FenceToken, Gate, ResourceKey};

/// A registration body is `{"token": N}`; anything much larger is not one.
const REGISTRATION_BYTES_MAX: usize = 4096;

pub struct Admin {
    gate: Arc<Gate>,
    metrics: PrometheusHandle,
    /// `Bearer <token>` expected in `Authorization`, when configured.
    bearer: Option<String>,
    /// Who the listener answers to (`Host`): a page whose name was rebound to this address
    /// (DNS rebinding) gets 421.
    hosts: ServedHosts,
}

/// The `Host` values the admin listener answers to: the address it listens on (any address
/// when that is unspecified), `localhost` on a loopback or unspecified address, and the names
/// configured (`server.admin_host_names`); with the listener's port or none.
pub struct ServedHosts {
    listen: std::net::SocketAddr,
    names: Vec<String>,
}

impl ServedHosts {
    pub fn new(listen: std::net::SocketAddr, names: Vec<String>) -> Self {
        Self { listen, names }
    }

    /// Whether a request naming `authority` (its `Host`, or its URI's authority on HTTP/2) is
    /// for this listener. A request that names none is not a browser's: it is served.
    fn serves(&self, authority: Option<&str>) -> bool {
        let Some(authority) = authority else { return true };
        let Ok(authority) = authority.parse::<http::uri::Authority>() else { return false };
        if authority.port_u16().is_some_and(|port| port != self.listen.port()) {
            return false;
        }
        let host = authority.host();
        let ip = self.listen.ip();
        if let Ok(asked) = host.trim_start_matches('[').trim_end_matches(']').parse::<std::net::IpAddr>() {
            return ip.is_unspecified() || asked == ip;
        }
        if host.eq_ignore_ascii_case("localhost") {
            return ip.is_loopback() || ip.is_unspecified();
        }
        self.names.iter().any(|name| name.eq_ignore_ascii_case(host))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Registration {
    token: u64,
}

type AdminResponse = Response<Full<Bytes>>;

/// The token of an `Authorization: Bearer <token>` value (the scheme is case-insensitive).
fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let (scheme, token) = value.split_at_checked(7)?;
    scheme.eq_ignore_ascii_case(b"bearer ").then_some(token)
}

impl Admin {
    pub fn new(gate: Arc<Gate>, metrics: PrometheusHandle, admin_token: Option<String>, hosts: ServedHosts) -> Self {
        Self { gate, metrics, bearer: admin_token, hosts }
    }

    pub async fn handle(self: Arc<Self>, req: http::Request<Incoming>) -> Result<AdminResponse, Infallible> {
        let authority = req
            .uri()
            .authority()
            .map(|a| a.as_str())
            .or_else(|| req.headers().get(header::HOST).and_then(|h| h.to_str().ok()));
        if !self.hosts.serves(authority) {
            return Ok(problem(
                StatusCode::MISDIRECTED_REQUEST,
                "MisdirectedRequest",
                "this admin listener answers only to the address it listens on (and server.admin_host_names)",
            ));
        }
        // Probes of liveness and readiness need no token; everything else does, when one is set.
        let probe = req.method() == Method::GET && matches!(req.uri().path(), "/healthz" | "/readyz");
        if let Some(expected) = &self.bearer
            && !probe
        {
            let presented = req.headers().get(header::AUTHORIZATION).and_then(|v| bearer_token(v.as_bytes()));
            if !presented.is_some_and(|p| constant_time_eq(p, expected.as_bytes())) {
                return Ok(problem(StatusCode::UNAUTHORIZED, "Unauthorized", "a valid admin bearer token is required"));
            }
        }
        let path = req.uri().path().to_owned();
        let response = match (req.method(), path.as_str()) {
            (&Method::GET, "/healthz") => text(StatusCode::OK, "ok\n"),
            (&Method::GET, "/readyz") => match self.gate.ping().await {
                Ok(()) => text(StatusCode::OK, "ready\n"),
                Err(e) => problem(StatusCode::SERVICE_UNAVAILABLE, "FenceStoreUnavailable", &e.to_string()),
            },
            (&Method::GET, "/metrics") => {
                let mut resp = text(StatusCode::OK, &self.metrics.render());
                resp.headers_mut()
                    .insert(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8".parse().expect("static"));
                resp
            }
            (method, p) if p.starts_with("/v1/fences/") => {
                let raw = &p["/v1/fences/".len()..];
                match decode_resource(raw) {
                    Err(detail) => problem(StatusCode::BAD_REQUEST, "InvalidFencingResource", &detail),
                    Ok(resource) => match *method {
                        Method::GET => self.get_fence(&resource).await,
                        Method::PUT => self.put_fence(&resource, req.into_body()).await,
                        _ => problem(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", "use GET or PUT"),
                    },
                }
            }
            _ => problem(StatusCode::NOT_FOUND, "NotFound", "no such admin endpoint"),
        };
        Ok(response)
    }

    async fn get_fence(&self, resource: &ResourceKey) -> AdminResponse {
        match self.gate.fence(resource).await {
            Ok(Some(token)) => fence_json(StatusCode::OK, resource, token),
            Ok(None) => problem(StatusCode::NOT_FOUND, "NoSuchFence", "no token was ever accepted for this resource"),
            Err(e) => problem(StatusCode::SERVICE_UNAVAILABLE, "FenceStoreUnavailable", &e.to_string()),
        }
    }

    async fn put_fence(&self, resource: &ResourceKey, body: Incoming) -> AdminResponse {
        let bytes = match Limited::new(body, REGISTRATION_BYTES_MAX).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(_) => {
                return problem(StatusCode::BAD_REQUEST, "InvalidRequest", "the body is not a small JSON object");
            }
        };
        let registration: Registration = match serde_json::from_slice(&bytes) {
            Ok(r) => r,
            Err(e) => {
                let detail = format!("expected {{\"token\": <0..18446744073709551615>}}: {e}");
                return problem(StatusCode::BAD_REQUEST, "InvalidFencingToken", &detail);
            }
        };
        match self.gate.advance(resource, FenceToken(registration.token)).await {
            Ok(token) => {
                tracing::info!(resource = resource.as_str(), token = token.0, "fence registered");
                fence_json(StatusCode::OK, resource, token)
            }
            Err(AdmitError::Stale { current, .. }) => fence_json(StatusCode::CONFLICT, resource, current),
            Err(AdmitError::StoreUnavailable(e)) => {
                problem(StatusCode::SERVICE_UNAVAILABLE, "FenceStoreUnavailable", &e.to_string())
            }
            Err(e) => problem(StatusCode::SERVICE_UNAVAILABLE, "SlowDown", &e.to_string()),
        }
    }
}

fn decode_resource(raw: &str) -> Result<ResourceKey, String> {
    let decoded =
        crate::net::percent::decode(raw).ok_or_else(|| "the resource is not valid percent-encoded UTF-8".to_owned())?;
    ResourceKey::new(&decoded).map_err(|e| e.to_string())
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn text(status: StatusCode, body: &str) -> AdminResponse {
    let mut resp = Response::new(Full::new(Bytes::from(body.to_owned())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(header::CONTENT_TYPE, "text/plain; charset=utf-8".parse().expect("static"));
    resp
}

fn fence_json(status: StatusCode, resource: &ResourceKey, token: FenceToken) -> AdminResponse {
    let body = serde_json::json!({ "resource": resource.as_str(), "token": token.0 });
    json(status, "application/json", &body)
}

/// An RFC 9457 problem whose `type` ends in `code`.
fn problem(status: StatusCode, code: &str, detail: &str) -> AdminResponse {
    json(status, crate::net::problem::CONTENT_TYPE, &crate::net::problem::document(status, code, detail))
}

fn json(status: StatusCode, content_type: &'static str, body: &serde_json::Value) -> AdminResponse {
    let mut resp = Response::new(Full::new(Bytes::from(body.to_string())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(header::CONTENT_TYPE, content_type.parse().expect("static"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A DNS-rebinding page names its own host: refused. The listener's own address, with its
    /// port or none, `localhost` on loopback, and configured names are served.
    #[test]
    fn only_the_listeners_own_names_are_served() {
        let on = |listen: &str, names: &[&str]| {
            ServedHosts::new(listen.parse().unwrap(), names.iter().map(|n| (*n).to_owned()).collect())
        };
        let loopback = on("127.0.0.1:9001", &[]);
        for ok in [None, Some("127.0.0.1:9001"), Some("127.0.0.1"), Some("localhost:9001"), Some("LOCALHOST")] {
            assert!(loopback.serves(ok), "{ok:?}");
        }
        for refused in ["evil.example:9001", "evil.example", "127.0.0.1:80", "10.0.0.1:9001", "[::1]:9001", "a b"] {
            assert!(!loopback.serves(Some(refused)), "{refused}");
        }
        let any = on("0.0.0.0:9001", &["admin.internal"]);
        for ok in ["10.1.2.3:9001", "[fd00::1]:9001", "localhost", "Admin.Internal:9001"] {
            assert!(any.serves(Some(ok)), "{ok}");
        }
        assert!(!any.serves(Some("evil.example:9001")));
        let v6 = on("[::1]:9001", &[]);
        assert!(v6.serves(Some("[::1]:9001")) && v6.serves(Some("localhost")) && !v6.serves(Some("127.0.0.1:9001")));
    }

    #[test]
    fn resources_are_percent_decoded() {
        assert_eq!(decode_resource("bkt%2Fkey").unwrap().as_str(), "bkt/key");
        assert_eq!(decode_resource("job:a").unwrap().as_str(), "job:a");
        assert!(decode_resource("%zz").is_err());
        assert!(decode_resource("").is_err());
    }
}
