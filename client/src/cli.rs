//! What the command-line tools (`fencegate-lease`, `fencegate-worker`) share: how they reach
//! fencegate. The same flags and the same environment variables as the AWS tools, so a shell
//! that talks to fencegate with the aws CLI runs both tools as it is.

use crate::{Credentials, LeaseClient, LeaseError};

/// fencegate's S3 listener and the credential a tool signs with. There is no default
/// credential: a tool signs with the one it is given, never with a built-in secret.
#[derive(clap::Args, Debug, Clone)]
pub struct Connection {
    /// fencegate's S3 listener.
    #[arg(long, env = "FENCEGATE_ENDPOINT", default_value = "http://127.0.0.1:9000")]
    pub endpoint: String,
    /// The signing region fencegate accepts.
    #[arg(long, env = "AWS_REGION", default_value = "us-east-1")]
    pub region: String,
    /// The access key the tool signs with (for leases, `role = "lessee"` or `"issuer"`; a lease
    /// credential, with its session token, renews and releases its own lease).
    #[arg(long, env = "AWS_ACCESS_KEY_ID", hide_env_values = true)]
    pub access_key_id: String,
    #[arg(long, env = "AWS_SECRET_ACCESS_KEY", hide_env_values = true)]
    pub secret_access_key: String,
    /// The session token of a lease credential (what `fencegate-lease acquire --env` exports).
    #[arg(long, env = "AWS_SESSION_TOKEN", hide_env_values = true)]
    pub session_token: Option<String>,
}

impl Connection {
    /// The credential, named after the tool that uses it.
    pub fn credentials(&self, tool: &'static str) -> Credentials {
        Credentials::new(&self.access_key_id, &self.secret_access_key, self.session_token.clone(), None, tool)
    }

    /// A lease client on this connection.
    pub fn lease_client(&self, tool: &'static str) -> Result<LeaseClient, LeaseError> {
        LeaseClient::new(&self.endpoint, self.credentials(tool), &self.region)
    }
}
