//! Shared by the Rust black-box tests: a fencegate served in-process on loopback ports, and
//! real aws-sdk-s3 clients pointed at it.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use aws_sdk_s3::config::http::HttpResponse;
use aws_sdk_s3::config::{BehaviorVersion, Credentials, Region};
use fencegate::App;
use fencegate::config::Config;
use tokio::sync::oneshot;

pub const ACCESS_KEY: &str = "fencegate-dev";
pub const SECRET_KEY: &str = "fencegate-dev-secret";

/// A running fencegate; stopped when dropped.
pub struct Fencegate {
    pub s3: SocketAddr,
    pub admin: SocketAddr,
    pub dir: PathBuf,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Fencegate {
    /// Starts fencegate on the embedded store and local upstream in `dir`, with `extra` TOML
    /// appended (e.g. an `[upstream]` override is not possible this way; use `start_with`).
    pub async fn start_local(dir: &Path, extra: &str) -> Self {
        let upstream = format!("[upstream]\nkind = \"local\"\npath = \"{}\"\n", dir.join("objects").display());
        Self::start_with(dir, &upstream, extra).await
    }

    pub async fn start_with(dir: &Path, upstream_toml: &str, extra: &str) -> Self {
        let toml = format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
             [store]\nkind = \"embedded\"\npath = \"{}\"\n{upstream_toml}\n\
             [[credentials]]\naccess_key_id = \"{ACCESS_KEY}\"\nsecret_access_key = \"{SECRET_KEY}\"\n{extra}",
            dir.join("fences").display()
        );
        let config = Config::from_toml(&toml).expect("test config is valid");
        let app = App::build(config).await.expect("fencegate builds");
        let (s3, admin) = app.bind().await.expect("binds loopback");
        let (s3_addr, admin_addr) = (s3.local_addr().unwrap(), admin.local_addr().unwrap());
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            app.serve(s3, admin, async move {
                let _ = stopped.await;
            })
            .await
            .expect("fencegate serves");
        });
        Self { s3: s3_addr, admin: admin_addr, dir: dir.into(), stop: Some(stop), task: Some(task) }
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.s3)
    }

    /// Stops serving and waits until the store is closed, so the same directory can be
    /// reopened.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Fencegate {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// An aws-sdk-s3 client for `endpoint`, path-style, with the given credentials.
pub fn s3_client(endpoint: &str, access_key: &str, secret_key: &str) -> aws_sdk_s3::Client {
    let http = aws_smithy_http_client::Builder::new().build_http();
    let config = aws_sdk_s3::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(endpoint)
        .force_path_style(true)
        .credentials_provider(Credentials::new(access_key, secret_key, None, None, "test"))
        .http_client(http)
        .build();
    aws_sdk_s3::Client::from_conf(config)
}

/// A client for fencegate with the dev credentials.
pub fn client(fg: &Fencegate) -> aws_sdk_s3::Client {
    s3_client(&fg.endpoint(), ACCESS_KEY, SECRET_KEY)
}

/// The service error code, HTTP status and `Fencing-Token-Current` of a failed SDK call.
pub fn error_of<E>(err: &aws_sdk_s3::error::SdkError<E, HttpResponse>) -> (Option<String>, u16, Option<String>)
where
    E: aws_sdk_s3::error::ProvideErrorMetadata + std::fmt::Debug,
{
    let raw = err.raw_response().unwrap_or_else(|| panic!("no HTTP response: {err:?}"));
    let code = err.as_service_error().and_then(|e| e.code()).map(str::to_owned);
    let current = raw.headers().get("fencing-token-current").map(str::to_owned);
    (code, raw.status().as_u16(), current)
}
