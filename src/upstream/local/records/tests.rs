use super::*;

fn record(etag: &str, file: &str) -> ObjectRecord {
    ObjectRecord {
        etag: etag.into(),
        size: 1,
        modified_ms: 0,
        segments: vec![Segment { file: file.into(), size: 1 }],
        attributes: Attributes::default(),
        checksums: Checksums::default(),
    }
}

#[test]
fn keys_are_names_not_paths() {
    let dir = tempfile::tempdir().unwrap();
    let store = Records::open(dir.path()).unwrap();
    store.create_bucket("b").unwrap();
    let any = Precondition::default();
    for (key, file) in [("a", "1"), ("a/b", "2"), ("a//b", "3"), ("/a", "4"), ("a/b/", "5")] {
        store.commit_object("b", key, &any, &record(file, file)).unwrap();
    }
    let listed: Vec<String> = store.keys("b", "", None, 100).unwrap().into_iter().map(|(k, _)| k).collect();
    assert_eq!(listed, ["/a", "a", "a//b", "a/b", "a/b/"]);
    assert_eq!(store.object("b", "a//b").unwrap().etag, "3");
    assert_eq!(store.keys("b", "a/", Some("a/b"), 100).unwrap().len(), 1, "after a/b: a/b/ only");
}

#[test]
fn a_condition_is_judged_in_the_commit() {
    let dir = tempfile::tempdir().unwrap();
    let store = Records::open(dir.path()).unwrap();
    store.create_bucket("b").unwrap();
    let create_only = Precondition { if_none_match: Some(None), ..Default::default() };
    store.commit_object("b", "k", &create_only, &record("e1", "f1")).unwrap();
    assert!(matches!(
        store.commit_object("b", "k", &create_only, &record("e2", "f2")),
        Err(StoreError::PreconditionFailed)
    ));
    let swap = Precondition { if_match: Some(Some("e1".into())), ..Default::default() };
    assert_eq!(store.commit_object("b", "k", &swap, &record("e3", "f3")).unwrap(), ["f1"]);
    assert!(matches!(store.commit_object("b", "k", &swap, &record("e4", "f4")), Err(StoreError::PreconditionFailed)));
    assert!(matches!(store.delete_bucket("b"), Err(StoreError::BucketNotEmpty)));
    assert_eq!(store.delete_object("b", "k", &Precondition::default()).unwrap(), ["f3"]);
    // An upload in progress goes with its bucket (as in S3), its parts' files freed.
    let upload =
        UploadRecord { bucket: "b".into(), key: "k".into(), initiated_ms: 0, attributes: Attributes::default() };
    store.create_upload("u", &upload).unwrap();
    let part =
        PartRecord { etag: "e".into(), size: 1, modified_ms: 0, file: "p1".into(), checksums: Checksums::default() };
    store.commit_part("b", "k", "u", 1, &part).unwrap();
    assert_eq!(store.delete_bucket("b").unwrap(), ["p1"]);
    assert!(
        store.parts("u").unwrap().is_empty() && matches!(store.upload("b", "k", "u"), Err(StoreError::NoSuchUpload))
    );
}

#[test]
fn an_empty_or_foreign_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(DB_FILE), b"").unwrap();
    let err = Records::open(dir.path()).err().unwrap().to_string();
    assert!(err.contains("is empty"), "{err}");
    let old = tempfile::tempdir().unwrap();
    std::fs::create_dir(old.path().join("bucket")).unwrap();
    let err = Records::open(old.path()).err().unwrap().to_string();
    assert!(err.contains("not fencegate's local store") && err.contains("bucket"), "{err}");
}

#[test]
fn orphans_are_removed_at_open_and_named_files_kept() {
    let dir = tempfile::tempdir().unwrap();
    let store = Records::open(dir.path()).unwrap();
    store.create_bucket("b").unwrap();
    let (kept, path) = store.new_data_file();
    std::fs::write(&path, b"x").unwrap();
    store.commit_object("b", "k", &Precondition::default(), &record("e", &kept)).unwrap();
    let (_, orphan) = store.new_data_file();
    std::fs::write(&orphan, b"crash").unwrap();
    drop(store);
    let _store = Records::open(dir.path()).unwrap();
    assert!(path.exists() && !orphan.exists());
}

#[test]
fn a_completion_checks_its_parts_and_answers_a_retry_alike() {
    let dir = tempfile::tempdir().unwrap();
    let store = Records::open(dir.path()).unwrap();
    store.create_bucket("b").unwrap();
    let upload =
        UploadRecord { bucket: "b".into(), key: "k".into(), initiated_ms: 0, attributes: Attributes::default() };
    store.create_upload("u", &upload).unwrap();
    let part = |etag: &str, size: u64| PartRecord {
        etag: etag.into(),
        size,
        modified_ms: 0,
        file: format!("part-{etag}"),
        checksums: Checksums::default(),
    };
    store.commit_part("b", "k", "u", 1, &part("00", 1)).unwrap();
    store.commit_part("b", "k", "u", 2, &part("11", 1)).unwrap();
    assert!(matches!(store.commit_part("b", "other", "u", 3, &part("22", 1)), Err(StoreError::NoSuchUpload)));
    let any = Precondition::default();
    let complete = |listed: &[(u32, Option<String>)]| store.complete_upload("b", "k", "u", listed, &any);
    assert!(matches!(complete(&[(2, None), (1, None)]), Err(StoreError::InvalidPartOrder)));
    assert!(matches!(complete(&[(1, Some("ff".into()))]), Err(StoreError::InvalidPart(1))));
    assert!(matches!(complete(&[(3, None)]), Err(StoreError::InvalidPart(3))));
    assert!(matches!(complete(&[(1, None), (2, None)]), Err(StoreError::EntityTooSmall(1))));
    let must_exist = Precondition { if_match: Some(None), ..Default::default() };
    assert!(matches!(store.complete_upload("b", "k", "u", &[(2, None)], &must_exist), Err(StoreError::NoSuchKey)));
    let (completed, freed) = complete(&[(2, Some("11".into()))]).unwrap();
    assert_eq!(freed, ["part-00"], "the part left out is freed");
    assert_eq!(completed.segments, [Segment { file: "part-11".into(), size: 1 }]);
    // The upload is gone; a retry of its completion gets the same object, another key nothing.
    let (again, freed) = complete(&[(2, Some("11".into()))]).unwrap();
    assert_eq!((again.etag, freed), (completed.etag.clone(), vec![]));
    assert!(matches!(store.complete_upload("b", "k2", "u", &[(2, None)], &any), Err(StoreError::NoSuchUpload)));
    // Once the object changed, the retry no longer describes it.
    store.commit_object("b", "k", &any, &record("new", "f")).unwrap();
    assert!(matches!(complete(&[(2, None)]), Err(StoreError::NoSuchUpload)));
}

#[test]
fn multipart_etag_is_s3s() {
    // Two parts whose MD5s are all zeros and all ones.
    let etag = multipart_etag(["00000000000000000000000000000000", "ffffffffffffffffffffffffffffffff"].into_iter());
    assert!(etag.ends_with("-2") && etag.len() == 34, "{etag}");
}
