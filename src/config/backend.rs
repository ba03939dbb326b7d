//! The store and the upstream a config names, as one typed value each: `[store]` and
//! `[upstream]` are flat tables in the file (a key per field, overridable from the
//! environment), and which fields count depends on `kind`. [`StoreConfig::backend`] and
//! [`UpstreamConfig::backend`] are both the check of those fields and the only way the rest of
//! fencegate reads them, so nothing downstream assumes a field was validated.

use std::path::Path;

use super::validate::{Invalid, invalid};
use super::{Secret, StoreConfig, StoreKind, UpstreamConfig, UpstreamKind};

/// The fence store `[store]` names.
#[derive(Debug, Clone, Copy)]
pub enum StoreBackend<'a> {
    /// One process, one file (`store.path`).
    Embedded { path: &'a Path },
    /// `store.url`, or the seed nodes of a Redis Cluster (`store.cluster_urls`, `cluster`).
    Redis { urls: &'a [String], cluster: bool },
    /// The members of an etcd cluster (`store.endpoints`).
    Etcd { endpoints: &'a [String] },
}

impl StoreBackend<'_> {
    /// Whether several replicas may share the store (and so register their writes in it).
    pub fn is_shared(&self) -> bool {
        !matches!(self, Self::Embedded { .. })
    }
}

impl StoreConfig {
    /// The bounds on upload records (`store.upload_records_*`).
    pub fn upload_records(&self) -> crate::fence::RecordLimits {
        crate::fence::RecordLimits {
            per_caller: self.upload_records_per_caller_max,
            per_resource: self.upload_records_per_resource_max,
            count: self.upload_records_max,
            bytes: self.upload_records_bytes_max,
        }
    }

    /// The store, or the key at fault.
    pub fn backend(&self) -> Result<StoreBackend<'_>, Invalid> {
        match self.kind {
            StoreKind::Embedded => match &self.path {
                Some(path) => Ok(StoreBackend::Embedded { path }),
                None => Err(invalid("store.path", "required when store.kind = \"embedded\"")),
            },
            StoreKind::Redis => match (&self.url, self.cluster_urls.is_empty()) {
                (Some(url), true) => Ok(StoreBackend::Redis { urls: std::slice::from_ref(url), cluster: false }),
                (None, false) => Ok(StoreBackend::Redis { urls: &self.cluster_urls, cluster: true }),
                (None, true) => {
                    Err(invalid("store.url", "required when store.kind = \"redis\" (or store.cluster_urls)"))
                }
                (Some(_), false) => {
                    Err(invalid("store.cluster_urls", "set either store.url or store.cluster_urls, not both"))
                }
            },
            StoreKind::Etcd if self.endpoints.is_empty() => {
                Err(invalid("store.endpoints", "required when store.kind = \"etcd\""))
            }
            StoreKind::Etcd if !cfg!(feature = "etcd") => Err(invalid(
                "store.kind",
                "this fencegate was built without etcd support: build it with `cargo build --features etcd`",
            )),
            StoreKind::Etcd => Ok(StoreBackend::Etcd { endpoints: &self.endpoints }),
        }
    }
}

/// The upstream `[upstream]` names.
#[derive(Debug, Clone)]
pub enum UpstreamBackend<'a> {
    /// Objects in a directory of this host (`upstream.path`).
    Local { path: &'a Path },
    /// An S3-compatible service.
    S3(S3Endpoint<'a>),
}

/// An S3-compatible service at `scheme://authority/`, signed with the key given.
#[derive(Debug, Clone)]
pub struct S3Endpoint<'a> {
    pub scheme: http::uri::Scheme,
    pub authority: http::uri::Authority,
    pub access_key_id: &'a str,
    pub secret_access_key: &'a Secret,
}

impl UpstreamConfig {
    /// The upstream, or the key at fault.
    pub fn backend(&self) -> Result<UpstreamBackend<'_>, Invalid> {
        match self.kind {
            UpstreamKind::Local => match &self.path {
                Some(path) => Ok(UpstreamBackend::Local { path }),
                None => Err(invalid("upstream.path", "required when upstream.kind = \"local\"")),
            },
            UpstreamKind::S3 => {
                let (scheme, authority) = self.endpoint_root()?;
                let access_key_id = self
                    .access_key_id
                    .as_deref()
                    .ok_or_else(|| invalid("upstream.access_key_id", "required when upstream.kind = \"s3\""))?;
                let secret_access_key = self
                    .secret_access_key
                    .as_ref()
                    .ok_or_else(|| invalid("upstream.secret_access_key", "required when upstream.kind = \"s3\""))?;
                Ok(UpstreamBackend::S3(S3Endpoint { scheme, authority, access_key_id, secret_access_key }))
            }
        }
    }

    /// `upstream.endpoint`, which must be a root URL: a path or query would be dropped, as
    /// requests go to the endpoint's root.
    fn endpoint_root(&self) -> Result<(http::uri::Scheme, http::uri::Authority), Invalid> {
        let endpoint = self
            .endpoint
            .as_deref()
            .ok_or_else(|| invalid("upstream.endpoint", "required when upstream.kind = \"s3\""))?;
        let uri: http::Uri =
            endpoint.parse().map_err(|e| invalid("upstream.endpoint", format!("{endpoint:?} is not a URL: {e}")))?;
        let root = matches!(uri.path(), "" | "/") && uri.query().is_none();
        let http = matches!(uri.scheme_str(), Some("http" | "https"));
        match (uri.scheme(), uri.authority()) {
            (Some(scheme), Some(authority)) if http && root => Ok((scheme.clone(), authority.clone())),
            _ => Err(invalid(
                "upstream.endpoint",
                format!("{endpoint:?} must be http://host[:port] or https://host[:port], without a path"),
            )),
        }
    }
}
