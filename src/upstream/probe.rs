//! The start-up probe (G6): does the upstream really refuse a failed precondition?

use http::{Method, StatusCode};
use s3s::Body;

use super::{Upstream, UpstreamError};

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("no bucket to probe in (set upstream.probe_bucket, or create a bucket)")]
    NoBucket,
    #[error("the upstream ignores `{header}`: a conditional write that must fail answered {status}")]
    IgnoresPrecondition { header: &'static str, status: StatusCode },
    #[error("the upstream answered {status} to the probe's {step}")]
    Unexpected { step: &'static str, status: StatusCode },
    #[error("the upstream could not be reached")]
    Upstream(#[from] UpstreamError),
}

/// Writes a probe object in `bucket` (or the first bucket listed) and checks that both
/// `If-None-Match: *` on an existing object and a wrong `If-Match` are refused with 412.
/// Returns the bucket probed. The probe object is deleted afterwards.
pub async fn probe_preconditions(upstream: &dyn Upstream, bucket: Option<&str>) -> Result<String, ProbeError> {
    let bucket = match bucket {
        Some(b) => b.to_owned(),
        None => first_bucket(upstream).await?.ok_or(ProbeError::NoBucket)?,
    };
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let path = format!("/{bucket}/.fencegate-probe-{nanos}");

    let created = send(upstream, Method::PUT, &path, &[("if-none-match", "*")], "probe").await?;
    if !created.is_success() {
        return Err(ProbeError::Unexpected { step: "create", status: created });
    }
    let result = async {
        let again = send(upstream, Method::PUT, &path, &[("if-none-match", "*")], "probe").await?;
        if again != StatusCode::PRECONDITION_FAILED {
            return Err(ProbeError::IgnoresPrecondition { header: "If-None-Match: *", status: again });
        }
        let wrong =
            send(upstream, Method::PUT, &path, &[("if-match", "\"00000000000000000000000000000000\"")], "probe")
                .await?;
        if wrong != StatusCode::PRECONDITION_FAILED {
            return Err(ProbeError::IgnoresPrecondition { header: "If-Match", status: wrong });
        }
        Ok(())
    }
    .await;
    let _ = send(upstream, Method::DELETE, &path, &[], "").await;
    result.map(|()| bucket)
}

async fn send(
    upstream: &dyn Upstream,
    method: Method,
    path: &str,
    headers: &[(&'static str, &str)],
    body: &'static str,
) -> Result<StatusCode, ProbeError> {
    let mut builder = http::Request::builder().method(method).uri(path).header("content-length", body.len());
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    let req = builder.body(Body::from(body.to_owned())).expect("static probe request");
    Ok(upstream.send(req).await?.status())
}

async fn first_bucket(upstream: &dyn Upstream) -> Result<Option<String>, ProbeError> {
    use http_body_util::BodyExt;
    let req = http::Request::builder().method(Method::GET).uri("/").body(Body::empty()).expect("static request");
    let resp = upstream.send(req).await?;
    if !resp.status().is_success() {
        return Err(ProbeError::Unexpected { step: "bucket listing", status: resp.status() });
    }
    let bytes = resp.into_body().collect().await.map_err(UpstreamError::Transport)?.to_bytes();
    let text = String::from_utf8_lossy(&bytes);
    Ok(text.split("<Name>").nth(1).and_then(|rest| rest.split("</Name>").next()).map(str::to_owned))
}
