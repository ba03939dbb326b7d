//! The classic stalled-worker scenario and the G3 race, driven by the real aws-sdk-s3 client
//! through fencegate: on the embedded local upstream and against a real S3-compatible server.

mod common;

use std::time::Duration;

use aws_sdk_s3::Client;
use aws_sdk_s3::error::ProvideErrorMetadata;
use aws_sdk_s3::primitives::ByteStream;
use bytes::Bytes;
use common::{Fencegate, Moto, client, error_of, s3_client};

const BUCKET: &str = "jobs";

/// PutObject with `Fencing-Token: token` (and optionally `Fencing-Resource`).
async fn put(
    c: &Client,
    key: &str,
    token: u64,
    resource: Option<&'static str>,
    body: ByteStream,
) -> Result<String, (Option<String>, u16, Option<String>)> {
    c.put_object()
        .bucket(BUCKET)
        .key(key)
        .body(body)
        .customize()
        .mutate_request(move |req| {
            req.headers_mut().insert("fencing-token", token.to_string());
            if let Some(r) = resource {
                req.headers_mut().insert("fencing-resource", r);
            }
        })
        .send()
        .await
        .map(|out| out.e_tag().unwrap_or_default().to_owned())
        .map_err(|e| error_of(&e))
}

async fn get(c: &Client, key: &str) -> (Vec<u8>, Option<String>) {
    let out = c.get_object().bucket(BUCKET).key(key).send().await.expect("get_object");
    let stamp = out.metadata().and_then(|m| m.get("fencing-token")).cloned();
    (out.body.collect().await.unwrap().into_bytes().to_vec(), stamp)
}

/// A writes with 11, B with 12, A again with 11: A's second write is refused with 409 and the
/// object holds B's bytes, stamped 12.
async fn classic_scenario(c: &Client) {
    put(c, "report.csv", 11, None, ByteStream::from_static(b"A's first draft")).await.expect("A with 11");
    put(c, "report.csv", 12, None, ByteStream::from_static(b"B's report")).await.expect("B with 12");
    let (code, status, current) =
        put(c, "report.csv", 11, None, ByteStream::from_static(b"A overwrites")).await.expect_err("A must be refused");
    assert_eq!((code.as_deref(), status, current.as_deref()), (Some("FencingTokenStale"), 409, Some("12")));
    assert_eq!(get(c, "report.csv").await, (b"B's report".to_vec(), Some("12".into())));
}

#[tokio::test]
async fn classic_scenario_on_the_local_upstream() {
    let dir = tempfile::tempdir().unwrap();
    let fg = Fencegate::start_local(dir.path(), "").await;
    let c = client(&fg);
    c.create_bucket().bucket(BUCKET).send().await.unwrap();
    classic_scenario(&c).await;

    // The token also travels as object metadata, for clients that cannot set headers.
    let stale = c
        .put_object()
        .bucket(BUCKET)
        .key("report.csv")
        .metadata("fencing-token", "11")
        .body(ByteStream::from_static(b"x"))
        .send()
        .await;
    assert_eq!(error_of(&stale.unwrap_err()).1, 409);
    c.put_object()
        .bucket(BUCKET)
        .key("report.csv")
        .metadata("fencing-token", "13")
        .body(ByteStream::from_static(b"C"))
        .send()
        .await
        .unwrap();
    assert_eq!(get(&c, "report.csv").await, (b"C".to_vec(), Some("13".into())));
    fg.stop().await;
}

#[tokio::test]
async fn classic_scenario_against_a_real_s3_server() {
    let moto = Moto::start().await;
    let direct = s3_client(&moto.endpoint, "moto", "moto");
    direct.create_bucket().bucket(BUCKET).send().await.unwrap();

    let dir = tempfile::tempdir().unwrap();
    let fg = Fencegate::setup(dir.path()).upstream(&moto.upstream_toml(BUCKET)).start().await;
    classic_scenario(&client(&fg)).await;
    // The upstream itself holds B's bytes and B's stamp.
    assert_eq!(get(&direct, "report.csv").await, (b"B's report".to_vec(), Some("12".into())));
    fg.stop().await;
}

/// The harness itself: when another process holds the port picked for moto (a Redis cluster
/// node's bus once did, and reset the test's first request), or another test's moto does,
/// moto starts on the next port instead of the test talking to whatever listens there.
#[tokio::test]
async fn moto_moves_off_a_port_that_something_else_serves() {
    let squatter = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let taken = squatter.local_addr().unwrap().port();
    let serving = tokio::spawn(async move {
        while let Ok((stream, _)) = squatter.accept().await {
            drop(stream); // a reset, as a cluster bus gives an HTTP request
        }
    });
    let other = Moto::start().await; // answers like ours would
    let others = other.endpoint.rsplit(':').next().unwrap().parse::<u16>().unwrap();
    let moto = Moto::start_on_first_free([taken, others, common::free_port()]).await;
    assert_ne!(moto.endpoint, format!("http://127.0.0.1:{taken}"));
    assert_ne!(moto.endpoint, other.endpoint);
    s3_client(&moto.endpoint, "moto", "moto").create_bucket().bucket(BUCKET).send().await.unwrap();
    serving.abort();
}

/// A slow upload with token 11 is in flight when 12 arrives: 11 is cancelled before its body
/// completes, 12 is forwarded only after that, and the object ends as 12 wrote it (G3).
async fn race(
    fg: &Fencegate,
    c: &Client,
    key_old: &'static str,
    key_new: &'static str,
    resource: Option<&'static str>,
) {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<http_body::Frame<Bytes>, std::io::Error>>(4);
    const OLD_LEN: usize = 256 * 1024;
    let body = http_body_util::StreamBody::new(tokio_stream_from(rx));
    let slow = ByteStream::from_body_1_x(body);
    let old = tokio::spawn({
        let c = c.clone();
        async move {
            c.put_object()
                .bucket(BUCKET)
                .key(key_old)
                .content_length(OLD_LEN as i64)
                .body(slow)
                .customize()
                .mutate_request(move |req| {
                    req.headers_mut().insert("fencing-token", "11");
                    if let Some(r) = resource {
                        req.headers_mut().insert("fencing-resource", r);
                    }
                })
                .send()
                .await
                .map_err(|e| {
                    let (code, status, current) = error_of(&e);
                    (code, status, current, e.as_service_error().and_then(|e| e.message()).map(str::to_owned))
                })
        }
    });
    // Half of the old body is on its way; wait until the old write was admitted (its token is
    // the fence) so that 12 meets it in flight, not at admission.
    tx.send(Ok(http_body::Frame::data(Bytes::from(vec![b'o'; OLD_LEN / 2])))).await.unwrap();
    let fenced = resource.map_or_else(|| format!("{BUCKET}/{key_old}"), str::to_owned);
    fg.wait_for_fence(&fenced, 11).await;

    put(c, key_new, 12, resource, ByteStream::from_static(b"new holder")).await.expect("12 is admitted");
    // The rest of the old body arrives too late.
    let _ = tx.send(Ok(http_body::Frame::data(Bytes::from(vec![b'o'; OLD_LEN / 2])))).await;
    drop(tx);
    let old = tokio::time::timeout(Duration::from_secs(20), old).await.expect("old write ends").unwrap();
    let (code, status, current, message) = old.expect_err("the token-11 upload must not commit after 12");
    assert_eq!((code.as_deref(), status, current.as_deref()), (Some("FencingTokenStale"), 409, Some("12")));
    // Cut off while streaming, not refused at admission: the race really happened.
    assert!(message.as_deref().is_some_and(|m| m.contains("while its body was streaming")), "{message:?}");
    assert_eq!(get(c, key_new).await, (b"new holder".to_vec(), Some("12".into())));
    if key_old != key_new {
        let head = c.head_object().bucket(BUCKET).key(key_old).send().await;
        assert!(head.is_err(), "the cancelled upload left no object");
    }
}

fn tokio_stream_from<T: Send + 'static>(mut rx: tokio::sync::mpsc::Receiver<T>) -> impl futures_util::Stream<Item = T> {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

#[tokio::test]
async fn newer_token_cancels_a_slow_older_upload_on_the_same_object() {
    let dir = tempfile::tempdir().unwrap();
    let fg = Fencegate::start_local(dir.path(), "").await;
    let c = client(&fg);
    c.create_bucket().bucket(BUCKET).send().await.unwrap();
    race(&fg, &c, "same.bin", "same.bin", None).await;
    fg.stop().await;
}

#[tokio::test]
async fn newer_token_cancels_a_slow_older_upload_on_another_object_of_the_resource() {
    let dir = tempfile::tempdir().unwrap();
    let fg = Fencegate::start_local(dir.path(), "").await;
    let c = client(&fg);
    c.create_bucket().bucket(BUCKET).send().await.unwrap();
    race(&fg, &c, "part-a.bin", "part-b.bin", Some("job:r")).await;
    fg.stop().await;
}
