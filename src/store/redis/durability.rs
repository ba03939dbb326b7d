//! What a Redis server really keeps of an acknowledged change, read at start-up: fencegate
//! acknowledges an advance, a grant or a registration once Redis answered it, so a Redis that
//! answers before the change is on disk (or on its replicas, when one may be promoted) can lose
//! one that a writer already relies on (G3 "Across restarts, restores and defaults").

use std::time::Duration;

/// Each setting of the Redis at each URL that can lose an acknowledged change, said with what
/// to change; empty when none. `wait_replicas` is `store.wait_replicas`.
pub async fn lapses(urls: &[String], wait_replicas: u32, timeout: Duration) -> Vec<String> {
    let mut lapses = Vec::new();
    for url in urls {
        let shown = without_secrets(url);
        match tokio::time::timeout(timeout, settings(url)).await {
            Ok(Ok(settings)) => lapses.extend(settings.lapses(&shown, wait_replicas, urls.len() > 1)),
            Ok(Err(error)) => lapses.push(format!(
                "the Redis at {shown} does not say how it persists changes ({}): whether it keeps an acknowledged \
                 change cannot be checked",
                without_secrets(&error.to_string())
            )),
            Err(_) => lapses.push(format!(
                "the Redis at {shown} did not say how it persists changes within {} ms",
                timeout.as_millis()
            )),
        }
    }
    lapses
}

/// The settings that decide whether an acknowledged change survives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// `appendonly`: `yes` or `no`.
    pub(super) appendonly: String,
    /// `appendfsync`: `always`, `everysec` or `no`.
    pub(super) appendfsync: String,
    /// Replicas connected now (`INFO replication`'s `connected_slaves`).
    pub(super) replicas: u32,
}

impl Settings {
    /// What can be lost at `url` (shown without its secrets); `cluster`: a Redis Cluster, on
    /// which fencegate cannot wait for replicas.
    pub fn lapses(&self, url: &str, wait_replicas: u32, cluster: bool) -> Vec<String> {
        let mut lapses = Vec::new();
        if !self.appendonly.eq_ignore_ascii_case("yes") {
            lapses.push(format!(
                "the Redis at {url} has appendonly {:?}: a restart comes back from its last snapshot, without the \
                 advances, grants and registrations since (set appendonly yes and appendfsync always)",
                self.appendonly
            ));
        } else if !self.appendfsync.eq_ignore_ascii_case("always") {
            lapses.push(format!(
                "the Redis at {url} has appendfsync {:?}: a power loss drops the changes it answered since its last \
                 fsync (set appendfsync always)",
                self.appendfsync
            ));
        }
        if self.replicas > 0 && cluster {
            lapses.push(format!(
                "the Redis Cluster node at {url} has {} replica(s): a failover to one of them can lose changes \
                 already answered, and store.wait_replicas is not supported with a Redis Cluster (use the etcd \
                 store, or accept the risk)",
                self.replicas
            ));
        } else if self.replicas > 0 && wait_replicas == 0 {
            lapses.push(format!(
                "the Redis at {url} has {} replica(s) and store.wait_replicas = 0: a failover to one of them can \
                 lose changes already answered (set store.wait_replicas)",
                self.replicas
            ));
        }
        lapses
    }
}

async fn settings(url: &str) -> redis::RedisResult<Settings> {
    let client = redis::Client::open(url)?;
    let mut connection = client.get_multiplexed_async_connection().await?;
    let appendonly = config_get(&mut connection, "appendonly").await?;
    let appendfsync = config_get(&mut connection, "appendfsync").await?;
    let info: String = redis::cmd("INFO").arg("replication").query_async(&mut connection).await?;
    Ok(Settings { appendonly, appendfsync, replicas: connected_replicas(&info) })
}

async fn config_get(connection: &mut redis::aio::MultiplexedConnection, name: &str) -> redis::RedisResult<String> {
    let pair: Vec<String> = redis::cmd("CONFIG").arg("GET").arg(name).query_async(connection).await?;
    Ok(pair.into_iter().nth(1).unwrap_or_default())
}

/// `connected_slaves:N` of `INFO replication` (0 when absent: a replica or a server that does
/// not say).
pub(super) fn connected_replicas(info: &str) -> u32 {
    info.lines().find_map(|line| line.trim().strip_prefix("connected_slaves:")?.parse().ok()).unwrap_or(0)
}

/// `url` with its user name and password replaced by `***` (they go in no message or log).
pub fn without_secrets(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_owned() };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{scheme}://***{}", &rest[at..]),
        None => url.to_owned(),
    }
}
