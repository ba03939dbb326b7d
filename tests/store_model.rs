//! Model-based test of the embedded fence store: random sequences of loads, advances and
//! reopens (a restart) give exactly the answers of a plain in-memory model, so fences never go
//! back (G1) and every acknowledged advance survives a restart (G2).

use std::collections::HashMap;

use fencegate::fence::{AdvanceOutcome, FenceStore, FenceToken, ResourceKey};
use fencegate::store::EmbeddedStore;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Load(u8),
    Advance(u8, u64),
    /// Several advances issued at once, so the writer thread group-commits them.
    Concurrent(Vec<(u8, u64)>),
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    // Few resources and small tokens, so sequences revisit the same fences often.
    let resource = 0u8..4;
    let token = prop_oneof![0u64..20, Just(u64::MAX)];
    prop_oneof![
        3 => resource.clone().prop_map(Op::Load),
        5 => (resource.clone(), token.clone()).prop_map(|(r, t)| Op::Advance(r, t)),
        2 => prop::collection::vec((resource, token), 1..6).prop_map(Op::Concurrent),
        1 => Just(Op::Reopen),
    ]
}

fn key(r: u8) -> ResourceKey {
    ResourceKey::new(&format!("resource-{r}")).unwrap()
}

/// The model: a map that only ever grows.
fn model_advance(model: &mut HashMap<u8, u64>, r: u8, t: u64) -> AdvanceOutcome {
    match model.get(&r).copied() {
        Some(current) if current >= t => AdvanceOutcome::Unchanged {
            current: FenceToken(current),
        },
        previous => {
            model.insert(r, t);
            AdvanceOutcome::Advanced {
                previous: previous.map(FenceToken),
            }
        }
    }
}

async fn run(ops: Vec<Op>) {
    let dir = tempfile::tempdir().unwrap();
    let mut store = EmbeddedStore::open(dir.path()).unwrap();
    let mut model: HashMap<u8, u64> = HashMap::new();
    for op in ops {
        match op {
            Op::Load(r) => {
                assert_eq!(
                    store.load(&key(r)).await.unwrap(),
                    model.get(&r).copied().map(FenceToken),
                    "load {r}"
                );
            }
            Op::Advance(r, t) => {
                let want = model_advance(&mut model, r, t);
                assert_eq!(
                    store.advance(&key(r), FenceToken(t)).await.unwrap(),
                    want,
                    "advance {r} to {t}"
                );
            }
            Op::Concurrent(batch) => {
                // Issued together; the outcomes may interleave in any order, so only the end
                // state is compared: every resource ends at the maximum advanced to.
                let store_ref = &store;
                let futures = batch
                    .iter()
                    .map(|&(r, t)| async move { store_ref.advance(&key(r), FenceToken(t)).await });
                for outcome in futures_util::future::join_all(futures).await {
                    outcome.unwrap();
                }
                for &(r, t) in &batch {
                    model_advance(&mut model, r, t);
                }
                for &(r, _) in &batch {
                    assert_eq!(
                        store.load(&key(r)).await.unwrap(),
                        model.get(&r).copied().map(FenceToken)
                    );
                }
            }
            Op::Reopen => {
                drop(store);
                store = reopen(dir.path()).await;
            }
        }
    }
    drop(store);
    let store = reopen(dir.path()).await;
    for r in 0..4 {
        assert_eq!(
            store.load(&key(r)).await.unwrap(),
            model.get(&r).copied().map(FenceToken),
            "after reopen {r}"
        );
    }
}

/// Reopens once the previous writer thread let go of the file.
async fn reopen(path: &std::path::Path) -> EmbeddedStore {
    for _ in 0..200 {
        match EmbeddedStore::open(path) {
            Ok(store) => return store,
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(5)).await,
        }
    }
    panic!("the store could not be reopened");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]
    #[test]
    fn embedded_store_matches_the_model(ops in prop::collection::vec(op(), 1..40)) {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(run(ops));
    }
}
