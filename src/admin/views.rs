//! What the operator reads: the store's health and this replica, the fences (paged), the live
//! leases, the writes in flight. JSON, read only, and nothing secret in it (no lease id: it is
//! a capability).

use http::StatusCode;
use serde_json::json;

use super::{AdminResponse, json_response, problem};
use crate::feed::Feed;
use crate::fence::{Clock, SystemClock};
use crate::fence::{Gate, RESOURCE_BYTES_MAX, StoreError};
use crate::upstream::health::Reach;

/// A page of fences holds this many unless asked otherwise.
pub const FENCES_PAGE_DEFAULT: usize = 100;
/// ... and at most this many (`limit`), as do the leases listed.
pub const PAGE_MAX: usize = 1000;
/// Pages of leases read at most for one answer of `/v1/leases`, and the time spent starting
/// new ones.
pub const LEASE_PAGES_MAX: usize = 10;
pub const LEASE_WALK_MAX: std::time::Duration = std::time::Duration::from_secs(10);
/// Resources with writes in flight shown at most.
pub const INFLIGHT_RESOURCES_MAX: usize = 1000;

/// `prefix`, `after` and `limit` of a listing's query.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Query {
    pub prefix: String,
    pub after: Option<String>,
    pub limit: usize,
}

impl Query {
    /// Parses a listing's query string; an unknown parameter, a repeated one, a limit out of
    /// 1..=[`PAGE_MAX`] or a name longer than a resource's is refused.
    pub fn parse(raw: Option<&str>, default_limit: usize) -> Result<Self, String> {
        let mut query = Self { limit: default_limit, ..Self::default() };
        let mut seen = Vec::new();
        for (name, value) in form_urlencoded::parse(raw.unwrap_or_default().as_bytes()) {
            if seen.contains(&name) {
                return Err(format!("{name} is given twice"));
            }
            match name.as_ref() {
                "prefix" => query.prefix = value.into_owned(),
                "after" => query.after = Some(value.into_owned()).filter(|a| !a.is_empty()),
                "limit" => {
                    query.limit = value
                        .parse()
                        .ok()
                        .filter(|n| (1..=PAGE_MAX).contains(n))
                        .ok_or_else(|| format!("limit must be 1 to {PAGE_MAX}, got {value:?}"))?;
                }
                other => return Err(format!("unknown parameter {other:?} (prefix, after, limit)")),
            }
            seen.push(name);
        }
        let longest = query.prefix.len().max(query.after.as_ref().map_or(0, String::len));
        if longest > RESOURCE_BYTES_MAX {
            return Err(format!("prefix and after are resource names: at most {RESOURCE_BYTES_MAX} bytes"));
        }
        Ok(query)
    }
}

pub async fn status(gate: &Gate, feed: &Feed, upstream: &Reach, auth: bool) -> AdminResponse {
    let ready = gate.ping().await;
    // A store that does not answer lists nobody: this replica alone, without a second wait.
    let replicas = match ready {
        Ok(()) => super::replicas::seen(gate, feed.replica()).await,
        Err(_) => vec![feed.replica().to_string()],
    };
    let body = json!({
        "version": env!("CARGO_PKG_VERSION"),
        "replica": feed.replica().as_ref(),
        "store": {
            "kind": gate.store_kind(),
            "ready": ready.is_ok(),
            "detail": ready.err().map(|e| e.to_string()),
        },
        "upstream": {
            "ready": upstream.cause().is_none(),
            "detail": upstream.cause(),
        },
        // Advances held after an unclean start (reads, and writes that advance nothing, pass):
        // how long still, or null.
        "hold": gate.hold_remaining().map(|left| json!({
            "remaining_ms": u64::try_from(left.as_millis()).unwrap_or(u64::MAX),
            "why": "the last fencegate process did not shut down cleanly: writes it sent may still commit",
        })),
        // This replica and those the shared store saw lately.
        "replicas": replicas,
        "auth": auth,
    });
    json_response(StatusCode::OK, &body)
}

/// A page of fences; each names when and by whom this replica raised it, where it remembers
/// (`crate::feed::Advance`).
pub async fn fences(gate: &Gate, feed: &Feed, query: Option<&str>) -> AdminResponse {
    let query = match Query::parse(query, FENCES_PAGE_DEFAULT) {
        Ok(query) => query,
        Err(detail) => return problem(StatusCode::BAD_REQUEST, "InvalidArgument", &detail),
    };
    match gate.listings().fences(&query.prefix, query.after.as_deref(), query.limit).await {
        Ok(page) => {
            let fences: Vec<_> = page
                .items
                .iter()
                .map(|(r, t)| {
                    let advance = feed.advance(r.as_str(), t.0);
                    json!({
                        "resource": r.as_str(),
                        "token": t.0,
                        "advanced_at_ms": advance.as_ref().map(|a| a.at_ms),
                        "advanced_by": advance.as_ref().and_then(|a| a.by.as_deref()),
                    })
                })
                .collect();
            json_response(StatusCode::OK, &json!({ "fences": fences, "next": page.next }))
        }
        Err(e) => unavailable(&e),
    }
}

/// The live leases: pages of [`PAGE_MAX`] of the store's leases are read until `limit` live
/// ones are found or [`LEASE_PAGES_MAX`] pages were read (expired leases are kept until a grant
/// replaces them, so a prefix may hold many); `next` tells where to go on from.
pub async fn leases(gate: &Gate, query: Option<&str>) -> AdminResponse {
    let query = match Query::parse(query, PAGE_MAX) {
        Ok(query) => query,
        Err(detail) => return problem(StatusCode::BAD_REQUEST, "InvalidArgument", &detail),
    };
    let now_ms = SystemClock.now_ms();
    let (mut live, mut after) = (Vec::new(), query.after);
    let started = std::time::Instant::now();
    for _ in 0..LEASE_PAGES_MAX {
        if started.elapsed() >= LEASE_WALK_MAX {
            break; // a Redis page walks the keyspace: answer with what was read
        }
        let page = match gate.listings().leases(&query.prefix, after.as_deref(), PAGE_MAX).await {
            Ok(page) => page,
            Err(e) => return unavailable(&e),
        };
        for (resource, lease) in page.items.iter().filter(|(_, lease)| lease.is_live(now_ms)) {
            if live.len() == query.limit {
                // One live lease past the page: the page ends before it.
                return json_response(StatusCode::OK, &json!({ "leases": live, "next": after }));
            }
            live.push(json!({
                "resource": resource.as_str(),
                "holder": lease.holder,
                "token": lease.token.0,
                "ttl_ms": lease.ttl_ms,
                "expires_in_ms": lease.expires_at_ms - now_ms,
            }));
            after = Some(resource.as_str().to_owned());
        }
        match page.next {
            Some(next) => after = Some(next),
            None => return json_response(StatusCode::OK, &json!({ "leases": live, "next": null })),
        }
    }
    json_response(StatusCode::OK, &json!({ "leases": live, "next": after }))
}

pub fn inflight(gate: &Gate, feed: &Feed) -> AdminResponse {
    let resources: Vec<_> = gate
        .inflight(INFLIGHT_RESOURCES_MAX)
        .iter()
        .map(|view| {
            json!({
                "resource": view.resource.as_str(),
                "writes": view.tokens.len(),
                "tokens": view.tokens.iter().map(|t| t.0).collect::<Vec<_>>(),
                "oldest_ms": crate::fence::millis(view.oldest),
                "newer_waiting": view.newer_waiting,
            })
        })
        .collect();
    json_response(StatusCode::OK, &json!({ "replica": feed.replica().as_ref(), "resources": resources }))
}

fn unavailable(error: &StoreError) -> AdminResponse {
    problem(StatusCode::SERVICE_UNAVAILABLE, "FenceStoreUnavailable", &error.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listing_queries_are_read_strictly() {
        let q = Query::parse(Some("prefix=job%3A&after=job%3Aa&limit=5"), 100).unwrap();
        assert_eq!(q, Query { prefix: "job:".into(), after: Some("job:a".into()), limit: 5 });
        assert_eq!(Query::parse(None, 100).unwrap(), Query { limit: 100, ..Query::default() });
        assert_eq!(Query::parse(Some("after="), 7).unwrap().after, None);
        for bad in ["limit=0", "limit=1001", "limit=x", "limit=-1", "prefix=a&prefix=b", "fences=1"] {
            assert!(Query::parse(Some(bad), 100).is_err(), "{bad}");
        }
        let long = format!("prefix={}", "a".repeat(RESOURCE_BYTES_MAX + 1));
        assert!(Query::parse(Some(&long), 100).is_err());
    }
}
