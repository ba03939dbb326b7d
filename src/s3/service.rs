//! The S3 service as s3s builds it: authentication (`[[credentials]]` and lease credentials),
//! virtual hosts under `server.domain`, bucket naming, and one catch-all route that hands lease
//! endpoints to the lease service and every other request to the S3 front.

use std::sync::Arc;
use std::time::SystemTime;

use http::{HeaderMap, Method};
use s3s::route::S3Route;
use s3s::service::S3ServiceBuilder;
use s3s::{Body, S3Request, S3Response, S3Result};

use super::auth::{self, Service};
use super::signed::Signature;
use super::{Front, FrontError, lean};
use crate::config::Config;
use crate::feed::Feed;
use crate::fence::Gate;
use crate::lease::LeaseService;
use crate::lease::credentials::{ACCESS_KEY_PREFIX, Issuers};
use crate::upstream::{Enforcement, Upstream};

/// Builds the S3 service: authentication from `[[credentials]]` and lease credentials, virtual
/// hosts from `server.domain`, and fencegate's handler behind it. `enforcement`: what the
/// start-up probe found the upstream judges (`None`: not probed).
pub fn service(
    config: &Config,
    gate: Arc<Gate>,
    upstream: Arc<dyn Upstream>,
    leases: Arc<LeaseService>,
    issuers: Arc<Issuers>,
    enforcement: Option<Enforcement>,
    feed: Arc<Feed>,
) -> anyhow::Result<Service> {
    let fixed: std::collections::HashMap<String, String> =
        config.credentials.iter().map(|c| (c.access_key_id.clone(), c.secret_access_key.expose().to_owned())).collect();
    // Across replicas a copy must be refused per object when it lands late (G4); on an upstream
    // that ignores `If-Match` on copies, it is made as a read and a conditional PUT instead.
    let copy_by_read_and_put = gate.is_shared() && enforcement.is_some_and(|e| !e.copy_object);
    // Unprobed, a remote upstream is trusted to judge nothing.
    let judged = enforcement.unwrap_or_else(|| upstream.enforcement_without_probe());
    let front = Front::new(config, gate, upstream, feed, leases.clock(), judged, copy_by_read_and_put)?;
    let route_front = Arc::new(front);
    let route =
        FencegateRoute { front: route_front.clone(), leases, issuers: issuers.clone(), sigv2: config.server.sigv2 };
    // Virtual-hosted addressing is the library's to parse: with `server.domain`, no lean path.
    let lean = config.server.domain.is_none().then(|| {
        Arc::new(lean::LeanPath {
            verifier: crate::aws::sigv4::Verifier::new(fixed.clone()),
            issuers: issuers.clone(),
            route: Arc::new(route.clone()),
        })
    });
    let mut builder = S3ServiceBuilder::new(NoOperations);
    builder.set_auth(auth::Credentials { fixed, issuers });
    builder.set_route(route);
    builder.set_validation(lean::BucketNames);
    if let Some(domain) = &config.server.domain {
        builder.set_host(VirtualHosts { domain: domain.to_ascii_lowercase() });
    }
    let service =
        auth::Service { inner: builder.build(), lean, front: route_front, region: config.upstream.region.clone() };
    Ok(service)
}

/// Virtual-hosted addressing under `server.domain`: `bucket.<domain>[:port]` names the bucket;
/// any other host (the domain itself, an IP, `localhost`) is path-style. The port is not part
/// of the name (s3s's own parser keeps it, and then sees `bucket.domain:9000` as a bucket).
struct VirtualHosts {
    domain: String,
}

impl s3s::host::S3Host for VirtualHosts {
    fn parse_host_header<'a>(&'a self, host: &'a str) -> S3Result<s3s::host::VirtualHost<'a>> {
        let name = match host.rsplit_once(':') {
            Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
            _ => host,
        };
        let bucket = name
            .len()
            .checked_sub(self.domain.len() + 1)
            .filter(|&end| name[end..].eq_ignore_ascii_case(&format!(".{}", self.domain)))
            .map(|end| &name[..end])
            .filter(|bucket| !bucket.is_empty());
        let host = s3s::host::VirtualHost::new(self.domain.as_str());
        Ok(match bucket {
            Some(bucket) => host.with_bucket(bucket.to_ascii_lowercase()),
            None => host,
        })
    }
}

/// s3s wants an implementation of its typed operations; fencegate's route takes every request
/// before they are reached.
struct NoOperations;

#[async_trait::async_trait]
impl s3s::S3 for NoOperations {}

/// Every authenticated request: lease endpoints to the lease service, the rest to the S3 front.
#[derive(Clone)]
struct FencegateRoute {
    pub(super) front: Arc<Front>,
    pub(super) leases: Arc<LeaseService>,
    /// The issuers (`role = "issuer"`), whose secrets make lease credentials.
    pub(super) issuers: Arc<Issuers>,
    /// `server.sigv2`: whether SigV2 signatures are accepted at all.
    pub(super) sigv2: bool,
}

#[async_trait::async_trait]
impl S3Route for FencegateRoute {
    fn is_match(&self, _: &Method, _: &http::Uri, _: &HeaderMap, _: &mut http::Extensions) -> bool {
        true
    }

    async fn call(&self, mut req: S3Request<Body>) -> S3Result<S3Response<Body>> {
        auth::routed();
        // Told by the service wrapper before the library saw the request (`auth::Service`).
        let told = match req.extensions.remove::<Signature>() {
            Some(signature) => Ok(signature),
            None => Signature::of(&req.method, req.uri.query(), &req.headers),
        };
        let signature = match told.and_then(|sig| sig.check(&req.headers, self.sigv2, SystemTime::now()).map(|()| sig))
        {
            Ok(signature) => signature,
            Err(error) => return Ok(self.front.refuse(error)),
        };
        if LeaseService::handles(req.uri.path()) {
            if signature.is_sigv2() {
                // SigV2 signs no body: the token or holder the body names would be anybody's.
                return Ok(self.front.refuse(FrontError::SigV2Refused("grant a lease or register a token")));
            }
            // A lease credential acts for its lease, as the credential that took it (verified
            // with the secret derived from these claims, by the lean path or the library).
            let held = match req.credentials.as_ref() {
                Some(c) if c.access_key.starts_with(ACCESS_KEY_PREFIX) => {
                    req.extensions.remove::<lean::LeaseClaims>().map(|verified| verified.0).or_else(auth::lease_claims)
                }
                _ => None,
            };
            let signer = match &held {
                Some(claims) => claims.parent.clone(),
                None => req.credentials.as_ref().map(|c| c.access_key.clone()).unwrap_or_default(),
            };
            let issuer = held.is_none() && self.issuers.is_issuer(&signer);
            let lessee = self.issuers.may_lease(&signer);
            // The body names the token or the holder: it must be signed too (its SHA-256 in
            // `x-amz-content-sha256`, which the signature covers and the library checks the
            // body against), or whoever sees the request could resend it with another body.
            let body_signed = signature.covers(crate::aws::amz::X_AMZ_CONTENT_SHA256.as_str())
                && req
                    .headers
                    .get(crate::aws::amz::X_AMZ_CONTENT_SHA256)
                    .is_some_and(|v| v.len() == 64 && v.as_bytes().iter().all(u8::is_ascii_hexdigit));
            let access_key = signer;
            let scope = self
                .front
                .scopes
                .get(&access_key)
                .map(|s| crate::lease::FenceScope { entries: s.0.clone(), rules: self.front.ctx.wire.rules.clone() });
            let caller = crate::lease::Caller {
                access_key,
                issuer,
                lessee,
                held,
                scope,
                signed: body_signed && !signature.is_presigned(),
            };
            return Ok(self.leases.handle(&req.method, req.uri.path(), req.input, caller).await);
        }
        let lease = match req.credentials.as_ref() {
            Some(c) if c.access_key.starts_with(ACCESS_KEY_PREFIX) => {
                // Verified with the secret derived from these claims: they are the signer's
                // (the lean path's, or the library's check through `auth::Credentials`).
                let lean = req.extensions.remove::<lean::LeaseClaims>().map(|verified| verified.0);
                match lean.or_else(auth::lease_claims) {
                    Some(claims) => Some(claims),
                    None => return Err(s3s::s3_error!(AccessDenied, "a lease credential without its claims")),
                }
            }
            _ => None,
        };
        self.front.clone().handle(req, lease, signature).await
    }
}
