//! A fence store in memory: not durable, so never selectable by config. It exists for unit
//! tests of the gate and as the reference the other stores are compared with.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;

use crate::fence::{AdvanceOutcome, FenceStore, FenceToken, ResourceKey, StoreError};

#[derive(Default)]
pub struct MemoryStore {
    fences: Mutex<HashMap<ResourceKey, FenceToken>>,
    /// Makes every call fail, to test that callers fail closed.
    failing: AtomicBool,
}

impl MemoryStore {
    pub fn set_failing(&self, failing: bool) {
        self.failing.store(failing, Ordering::SeqCst);
    }

    fn check(&self) -> Result<(), StoreError> {
        if self.failing.load(Ordering::SeqCst) {
            return Err(StoreError::Backend("memory store told to fail".into()));
        }
        Ok(())
    }
}

#[async_trait]
impl FenceStore for MemoryStore {
    async fn load(&self, resource: &ResourceKey) -> Result<Option<FenceToken>, StoreError> {
        self.check()?;
        Ok(self
            .fences
            .lock()
            .expect("memory store lock")
            .get(resource)
            .copied())
    }

    async fn advance(
        &self,
        resource: &ResourceKey,
        token: FenceToken,
    ) -> Result<AdvanceOutcome, StoreError> {
        self.check()?;
        let mut fences = self.fences.lock().expect("memory store lock");
        let previous = fences.get(resource).copied();
        match previous {
            Some(current) if current >= token => Ok(AdvanceOutcome::Unchanged { current }),
            _ => {
                fences.insert(resource.clone(), token);
                Ok(AdvanceOutcome::Advanced { previous })
            }
        }
    }

    fn kind(&self) -> &'static str {
        "memory"
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.check()
    }
}
