use super::*;

#[test]
fn keys_of_one_resource_share_a_hash_tag() {
    let r = ResourceKey::new("job:{a}}%").unwrap();
    assert_eq!(key(&r, "fence"), "fg:{job:{a%7D%7D%25}:fence");
    assert_eq!(key(&r, "inflight"), "fg:{job:{a%7D%7D%25}:inflight");
    let k = IdempotencyKey::new(r, b"request");
    assert_eq!(idempotency_key(&k), format!("fg:{{job:{{a%7D%7D%25}}:idem:{}", k.request_digest()));
}

/// The slot's epoch keys are on the slot Redis Cluster puts the resource's keys on: the
/// hash tag is the text between the key's first `{` and the next `}`.
#[test]
fn a_resources_epoch_keys_share_its_slot() {
    let r = ResourceKey::new("job:{a}}%").unwrap();
    let marked = EpochKeys::of(&key(&r, "fence"));
    assert_eq!(marked.slot, epoch::slot_of_tag("job:{a%7D%7D%25"));
    let tag = |k: &str| k.split_once('{').unwrap().1.split_once('}').unwrap().0.to_owned();
    assert_eq!(epoch::slot_of_tag(&tag(&marked.epoch)), marked.slot);
    assert_eq!(epoch::slot_of_tag(&tag(&marked.quiet)), marked.slot);
}

/// Copying in runs escapes exactly what escaping each character does.
#[test]
fn keys_escape_as_character_by_character() {
    let by_character = |raw: &str| {
        let escaped: String = raw
            .chars()
            .map(|c| match c {
                '%' => "%25".to_owned(),
                '}' => "%7D".to_owned(),
                c => c.to_string(),
            })
            .collect();
        format!("fg:{{{escaped}}}:fence")
    };
    for raw in ["a", "%", "}", "%}", "job-1", "}}x%%", "é}ü%ß", "a}b%c}d", "日本}%語", "x%"] {
        let r = ResourceKey::new(raw).unwrap();
        assert_eq!(key(&r, "fence"), by_character(raw), "{raw}");
    }
}

// What a Redis keeps of an answered change (`durability.rs`).

use super::durability::{Settings, connected_replicas, without_secrets};

fn durability_settings(appendonly: &str, appendfsync: &str, replicas: u32) -> Settings {
    Settings { appendonly: appendonly.into(), appendfsync: appendfsync.into(), replicas }
}

#[test]
fn only_an_fsync_always_log_with_waited_replicas_keeps_every_answered_change() {
    assert!(durability_settings("yes", "always", 0).lapses("u", 0, false).is_empty());
    assert!(durability_settings("yes", "always", 2).lapses("u", 1, false).is_empty());
    let lapses = durability_settings("no", "everysec", 0).lapses("u", 0, false);
    assert_eq!(lapses.len(), 1);
    assert!(lapses[0].contains("appendonly \"no\""), "{lapses:?}");
    assert!(durability_settings("yes", "everysec", 0).lapses("u", 0, false)[0].contains("appendfsync \"everysec\""));
    assert!(durability_settings("yes", "always", 1).lapses("u", 0, false)[0].contains("store.wait_replicas = 0"));
    assert_eq!(durability_settings("no", "no", 1).lapses("u", 0, false).len(), 2);
}

#[test]
fn the_replica_count_is_read_from_info_replication() {
    let info = "# Replication\r\nrole:master\r\nconnected_slaves:2\r\nslave0:ip=127.0.0.1\r\n";
    assert_eq!(connected_replicas(info), 2);
    assert_eq!(connected_replicas("# Replication\r\nrole:slave\r\n"), 0);
}

#[test]
fn a_redis_url_is_shown_without_its_secrets() {
    assert_eq!(without_secrets("redis://:s3cret@127.0.0.1:6379/0"), "redis://***@127.0.0.1:6379/0");
    assert_eq!(without_secrets("rediss://user:pw@host"), "rediss://***@host");
    assert_eq!(without_secrets("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
    assert!(durability_settings("no", "always", 1).lapses("u", 0, true).iter().any(|l| l.contains("Redis Cluster")));
}
