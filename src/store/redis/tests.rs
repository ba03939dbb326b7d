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
