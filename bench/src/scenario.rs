//! The scenarios: which requests each connection sends, signed ahead of the timed run.
//!
//! Every scenario writes into one bucket under keys that carry a run id, so a run never
//! collides with the fences or objects of an earlier one against the same fencegate.

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request};
use http_body_util::Full;

use crate::sign::Signer;

/// Distinct requests signed at most per scenario; longer runs replay them.
pub const SIGNED_REQUESTS_MAX: usize = 200_000;

/// The lease of the lease-credentials scenario; the bench config binds the bucket's `lease-`
/// keys to it.
pub const LEASE: &str = "bench:lease";

const FENCING_TOKEN: HeaderName = HeaderName::from_static("fencing-token");
const FENCING_RESOURCE: HeaderName = HeaderName::from_static("fencing-resource");

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// 1 KiB writes with the current token, each connection on its own objects (one resource
    /// per object, many resources).
    Accepted,
    /// 1 KiB writes with the current token, every connection on one resource
    /// (`Fencing-Resource`), each on its own objects.
    AcceptedOneResource,
    /// 1 KiB writes signed with lease credentials, no fencing header: every connection on the
    /// lease's resource, each on its own objects (the lease-credential twin of
    /// `AcceptedOneResource`). The signer must hold the credentials of lease [`LEASE`].
    AcceptedLease,
    /// Every request presents a new, higher token (each connection has its own resource).
    Advancing,
    /// Every request presents a token below the fence (primed by one write with a higher token).
    Stale,
}

impl Scenario {
    pub fn name(self) -> &'static str {
        match self {
            Self::Accepted => "accepted",
            Self::AcceptedOneResource => "accepted-one-resource",
            Self::AcceptedLease => "accepted-lease",
            Self::Advancing => "advancing",
            Self::Stale => "stale",
        }
    }
}

/// One request, signed, ready to be cloned and sent.
#[derive(Clone)]
pub struct Plan {
    pub method: Method,
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Plan {
    pub fn request(&self) -> Request<Full<Bytes>> {
        let mut req = Request::new(Full::new(self.body.clone()));
        *req.method_mut() = self.method.clone();
        *req.uri_mut() = self.path.parse().expect("plans carry valid paths");
        *req.headers_mut() = self.headers.clone();
        req
    }
}

/// Where the requests of a run come from: connection `conn` sends its `i`-th request next.
pub trait Source: Send + Sync + 'static {
    /// `None` when connection `conn` has nothing more to send.
    fn request(&self, conn: usize, i: u64) -> Option<Request<Full<Bytes>>>;
}

/// Pre-signed requests per connection, replayed in a cycle or sent once each.
pub struct Signed {
    pub per_connection: Vec<Vec<Plan>>,
    pub cycle: bool,
}

impl Source for Signed {
    fn request(&self, conn: usize, i: u64) -> Option<Request<Full<Bytes>>> {
        let plans = self.per_connection.get(conn)?;
        if plans.is_empty() {
            return None;
        }
        let index = if self.cycle {
            (i % plans.len() as u64) as usize
        } else {
            usize::try_from(i).ok().filter(|&i| i < plans.len())?
        };
        Some(plans[index].request())
    }
}

/// What every scenario needs to build its requests.
pub struct Params<'a> {
    pub signer: &'a Signer,
    /// `host:port` the requests are sent to (part of the signature).
    pub authority: String,
    pub bucket: String,
    pub run_id: String,
    pub connections: usize,
    pub keys_per_connection: usize,
    pub body: Bytes,
    /// Bounds the advancing scenario, whose requests cannot repeat.
    pub requests_max: u64,
}

impl Params<'_> {
    pub fn plan(
        &self,
        method: Method,
        key: &str,
        token: Option<u64>,
        resource: Option<&str>,
        body: Bytes,
    ) -> anyhow::Result<Plan> {
        let mut plan = self.head(method, key, token, resource, body.len() as u64)?;
        plan.body = body;
        Ok(plan)
    }

    /// A signed head announcing `content_length` body bytes, for callers that stream the
    /// body themselves.
    pub fn head(
        &self,
        method: Method,
        key: &str,
        token: Option<u64>,
        resource: Option<&str>,
        content_length: u64,
    ) -> anyhow::Result<Plan> {
        let path = format!("/{}/{key}", self.bucket);
        let mut extra = Vec::new();
        if method == Method::PUT {
            extra.push((http::header::CONTENT_LENGTH, HeaderValue::from(content_length)));
        }
        if let Some(token) = token {
            extra.push((FENCING_TOKEN, HeaderValue::from(token)));
        }
        if let Some(resource) = resource {
            extra.push((FENCING_RESOURCE, HeaderValue::from_str(resource)?));
        }
        let headers = self.signer.sign(&method, &self.authority, &path, &extra)?;
        Ok(Plan { method, path, headers, body: Bytes::new() })
    }

    fn put(&self, key: &str, token: u64, resource: Option<&str>) -> anyhow::Result<Plan> {
        self.plan(Method::PUT, key, Some(token), resource, self.body.clone())
    }
}

/// The requests of a scenario: an untimed priming pass (each request once) and the timed run.
pub struct Workload {
    pub prime: Arc<Signed>,
    pub timed: Arc<Signed>,
}

pub fn build(scenario: Scenario, p: &Params<'_>) -> anyhow::Result<Workload> {
    let keys = p.keys_per_connection;
    let per_conn = |f: &dyn Fn(usize, usize) -> anyhow::Result<Plan>, n: usize| {
        (0..p.connections)
            .map(|c| (0..n).map(|i| f(c, i)).collect::<anyhow::Result<Vec<_>>>())
            .collect::<anyhow::Result<Vec<_>>>()
    };
    let run = &p.run_id;
    let (prime, timed, cycle) = match scenario {
        Scenario::Accepted => {
            let f = |c: usize, i: usize| p.put(&format!("acc-{run}-{c}-{i}"), 1, None);
            // The priming pass makes the first token the fence and leaves each object
            // present, so the timed run is the steady state: `t == F`, ETag known.
            (per_conn(&f, keys)?, per_conn(&f, keys)?, true)
        }
        Scenario::AcceptedOneResource => {
            let resource = format!("one-{run}");
            let f = |c: usize, i: usize| p.put(&format!("one-{run}-{c}-{i}"), 1, Some(&resource));
            (per_conn(&f, keys)?, per_conn(&f, keys)?, true)
        }
        Scenario::AcceptedLease => {
            let f =
                |c: usize, i: usize| p.plan(Method::PUT, &format!("lease-{run}-{c}-{i}"), None, None, p.body.clone());
            (per_conn(&f, keys)?, per_conn(&f, keys)?, true)
        }
        Scenario::Advancing => {
            let per = (p.requests_max as usize).min(SIGNED_REQUESTS_MAX).div_ceil(p.connections.max(1));
            // Each connection owns one object (its own resource) and raises its token by one
            // on every request: every request is an advance, made durable before forwarding.
            let f = |c: usize, i: usize| p.put(&format!("adv-{run}-{c}"), i as u64 + 1, None);
            (Vec::new(), per_conn(&f, per)?, false)
        }
        Scenario::Stale => {
            let prime = |c: usize, i: usize| p.put(&format!("stale-{run}-{c}-{i}"), 2, None);
            let timed = |c: usize, i: usize| p.put(&format!("stale-{run}-{c}-{i}"), 1, None);
            (per_conn(&prime, keys)?, per_conn(&timed, keys)?, true)
        }
    };
    Ok(Workload {
        prime: Arc::new(Signed { per_connection: prime, cycle: false }),
        timed: Arc::new(Signed { per_connection: timed, cycle }),
    })
}

/// Stale writes on resources picked uniformly among `resources` registered ones
/// (`lk-{run}-{i}`): each request is one fence lookup and a rejection, nothing upstream.
pub fn lookups(p: &Params<'_>, resources: u64, seed: u64) -> anyhow::Result<Workload> {
    let per = (p.requests_max as usize).min(SIGNED_REQUESTS_MAX).div_ceil(p.connections.max(1));
    let mut rng = fencegate::sim::rng::Rng::new(seed);
    let mut timed = Vec::with_capacity(p.connections);
    for c in 0..p.connections {
        let mut plans = Vec::with_capacity(per);
        for _ in 0..per {
            let r = rng.below(resources);
            let resource = lookup_resource(&p.run_id, r);
            plans.push(p.put(&format!("lk-{}-{c}", p.run_id), 1, Some(&resource))?);
        }
        timed.push(plans);
    }
    Ok(Workload {
        prime: Arc::new(Signed { per_connection: Vec::new(), cycle: false }),
        timed: Arc::new(Signed { per_connection: timed, cycle: true }),
    })
}

pub fn lookup_resource(run_id: &str, i: u64) -> String {
    format!("lk-{run_id}-{i}")
}

/// Registers fences `lookup_resource(run, i)` for `i` in `from..to` with token 2 through the
/// admin API (`PUT /v1/fences/{resource}`), generated on the fly: a million of them are not
/// kept in memory.
pub struct Registrations {
    pub run_id: String,
    pub admin_authority: String,
    pub from: u64,
    pub to: u64,
    pub connections: usize,
}

impl Source for Registrations {
    fn request(&self, conn: usize, i: u64) -> Option<Request<Full<Bytes>>> {
        let index = self.from + i * self.connections as u64 + conn as u64;
        if index >= self.to {
            return None;
        }
        let body = Bytes::from_static(b"{\"token\": 2}");
        Request::builder()
            .method(Method::PUT)
            .uri(format!("/v1/fences/{}", lookup_resource(&self.run_id, index)))
            .header(http::header::HOST, &self.admin_authority)
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(http::header::CONTENT_LENGTH, body.len())
            .body(Full::new(body))
            .ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sign::{ACCESS_KEY_ID, REGION, SECRET_ACCESS_KEY};

    fn params(signer: &Signer) -> Params<'_> {
        Params {
            signer,
            authority: "127.0.0.1:9".into(),
            bucket: "bench".into(),
            run_id: "r".into(),
            connections: 2,
            keys_per_connection: 3,
            body: Bytes::from_static(b"x"),
            requests_max: 10,
        }
    }

    /// Advancing requests raise the token by one per request on each connection.
    #[test]
    fn advancing_tokens_grow_per_connection() {
        let signer = Signer::new(ACCESS_KEY_ID, SECRET_ACCESS_KEY, REGION);
        let w = build(Scenario::Advancing, &params(&signer)).unwrap();
        assert!(w.prime.per_connection.is_empty());
        let tokens: Vec<String> = (0..5)
            .map(|i| {
                let req = w.timed.request(1, i).unwrap();
                req.headers()["fencing-token"].to_str().unwrap().to_owned()
            })
            .collect();
        assert_eq!(tokens, ["1", "2", "3", "4", "5"]);
        assert!(w.timed.request(1, 5).is_none(), "advancing never replays");
    }

    /// Stale requests present a token below the one the priming pass wrote.
    #[test]
    fn stale_requests_present_an_older_token_than_the_prime() {
        let signer = Signer::new(ACCESS_KEY_ID, SECRET_ACCESS_KEY, REGION);
        let w = build(Scenario::Stale, &params(&signer)).unwrap();
        let prime = w.prime.request(0, 0).unwrap();
        let timed = w.timed.request(0, 3).unwrap();
        assert_eq!(prime.uri(), timed.uri());
        assert_eq!(prime.headers()["fencing-token"], "2");
        assert_eq!(timed.headers()["fencing-token"], "1");
    }

    /// Registrations cover every index once across connections.
    #[test]
    fn registrations_partition_the_range() {
        let r = Registrations { run_id: "r".into(), admin_authority: "a".into(), from: 10, to: 17, connections: 3 };
        let mut seen = Vec::new();
        for c in 0..3 {
            let mut i = 0;
            while let Some(req) = r.request(c, i) {
                seen.push(req.uri().path().to_owned());
                i += 1;
            }
        }
        seen.sort();
        let want: Vec<String> = (10..17).map(|i| format!("/v1/fences/lk-r-{i}")).collect();
        assert_eq!(seen, want);
    }
}
