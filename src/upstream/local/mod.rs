//! The embedded upstream: fencegate's own S3 store on a local directory, driven in-process
//! through the same HTTP-shaped interface as a remote upstream (the S3 library parses each
//! request and renders each answer, as it does on the front).
//!
//! Objects are records in an embedded database and bytes in files named by a fresh id, never
//! by the key (records/): any key S3 allows is one object, `a` and `a/b` coexist, and no two
//! names reach the same bytes. Each write's preconditions (`If-Match`, `If-None-Match`, those
//! fencegate adds) are judged in the transaction that commits it, so a condition and its write
//! are one step; a body streams to its file before, with no lock held (ops/).

mod ops;
mod records;

use std::path::Path;

use async_trait::async_trait;
use s3s::Body;
use s3s::service::{S3Service, S3ServiceBuilder};

use super::{Enforcement, Upstream, UpstreamError};

pub struct LocalUpstream {
    service: S3Service,
}

impl LocalUpstream {
    pub fn open(root: &Path) -> anyhow::Result<Self> {
        let records = records::Records::open(root)?;
        let service = S3ServiceBuilder::new(ops::LocalStore::new(records)).build();
        Ok(Self { service })
    }
}

#[async_trait]
impl Upstream for LocalUpstream {
    async fn send(&self, req: http::Request<Body>) -> Result<http::Response<Body>, UpstreamError> {
        self.service.call(req).await.map_err(|e| UpstreamError::Local(format!("{e:?}").into()))
    }

    fn kind(&self) -> &'static str {
        "local"
    }

    /// Every condition is judged in the transaction that commits its write, and an upload id
    /// is only good with the key it was started on (records/).
    fn enforcement_without_probe(&self) -> Enforcement {
        Enforcement {
            copy_object: true,
            complete_multipart_upload: true,
            delete_object: true,
            upload_ids_tied_to_keys: true,
        }
    }
}
