use super::*;

const T: fn(u64) -> FenceToken = FenceToken;

#[test]
fn keys_of_one_resource_never_reach_into_another() {
    let a = ResourceKey::new("jobs/a").unwrap();
    let m = Member { id: 3, token: T(7) };
    assert_eq!(member_key(&a, "r1", m), "fg/i/jobs/a\0r1:3:7");
    // `jobs/ab`'s registrations are outside `jobs/a`'s range.
    let ab = ResourceKey::new("jobs/ab").unwrap();
    assert!(!member_key(&ab, "r1", m).starts_with(&inflight_prefix(&a)));
    assert_eq!(member_token(member_key(&a, "host:9:1", m).as_bytes()), Some(T(7)));
}

#[test]
fn ttls_round_up_to_whole_seconds() {
    assert_eq!(ttl_seconds(1), 1);
    assert_eq!(ttl_seconds(1000), 1);
    assert_eq!(ttl_seconds(1001), 2);
    assert_eq!(ttl_seconds(30_000), 30);
}

#[test]
fn admission_follows_the_redis_script() {
    let admitted = |advanced| SharedAdmit::Admitted { advanced, repaired_from: None };
    // First token: advances.
    assert_eq!(
        decide_admission(None, None, T(5), true, false),
        Admission { answer: admitted(true), fence: Some(T(5)) }
    );
    // Same token: nothing to write.
    assert_eq!(
        decide_admission(Some(T(5)), None, T(5), true, false),
        Admission { answer: admitted(false), fence: None }
    );
    // Older: stale.
    assert_eq!(decide_admission(Some(T(5)), None, T(4), true, false).answer, SharedAdmit::Stale { current: T(5) });
    // Newer without the right to advance: unregistered, nothing written.
    assert_eq!(
        decide_admission(Some(T(5)), None, T(6), false, false),
        Admission { answer: SharedAdmit::Unregistered { current: Some(T(5)), repaired_from: None }, fence: None }
    );
    // Older writes in flight: the fence still advances, the write waits.
    assert_eq!(
        decide_admission(Some(T(5)), None, T(6), true, true),
        Admission { answer: SharedAdmit::OlderInflight { advanced: true, repaired_from: None }, fence: Some(T(6)) }
    );
    // The store below the replica's floor: raised back, and a token between is stale.
    assert_eq!(
        decide_admission(Some(T(3)), Some(T(8)), T(8), true, false),
        Admission {
            answer: SharedAdmit::Admitted { advanced: false, repaired_from: Some(Some(T(3))) },
            fence: Some(T(8))
        }
    );
    assert_eq!(
        decide_admission(Some(T(3)), Some(T(8)), T(6), true, false),
        Admission { answer: SharedAdmit::Stale { current: T(8) }, fence: Some(T(8)) }
    );
    assert_eq!(
        decide_admission(None, Some(T(8)), T(9), false, false),
        Admission {
            answer: SharedAdmit::Unregistered { current: Some(T(8)), repaired_from: Some(None) },
            fence: Some(T(8))
        }
    );
}
