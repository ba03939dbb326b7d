//! The feed's memory: the recent decisions of this replica, kept whether anyone watches or not,
//! so that a console opened after a refusal (or reloaded) still shows it; and, per resource,
//! when and by whom this replica last raised its fence. Bounded: refusals are kept longer than
//! acceptances, since they are what an operator comes to look at.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use serde::Serialize;

use crate::fence::ResourceKey;

/// Refusals kept (the newest). Each holds at most a resource name (`RESOURCE_BYTES_MAX`, 1 KiB),
/// an object name ([`super::decision::OBJECT_BYTES_MAX`], 1 KiB) and an access key id: about
/// 2 MiB in all at worst.
pub const RECENT_REFUSALS_MAX: usize = 1_000;
/// Accepted decisions kept: a sample when decisions contend for the feed's lock (a write never
/// waits for the history), all of them otherwise.
pub const RECENT_ACCEPTED_MAX: usize = 100;
/// Resources whose last advance is remembered; past it, the older half is forgotten.
pub const ADVANCES_REMEMBERED_MAX: usize = 10_000;

/// One decision as the feed keeps it, made into JSON only when it is sent or read.
#[derive(Debug, Clone, Default)]
pub(super) struct Recorded {
    pub(super) time_ms: u64,
    pub(super) operation: &'static str,
    pub(super) resource: Option<ResourceKey>,
    /// `bucket/key` (or the path), for a refusal that came before a resource was named.
    pub(super) object: Option<Arc<str>>,
    pub(super) token: Option<u64>,
    pub(super) fence: Option<u64>,
    pub(super) decision: &'static str,
    pub(super) detail: &'static str,
    pub(super) code: Option<&'static str>,
    pub(super) who: Option<Arc<str>>,
    /// A refusal's number in this process (the feed's event id is `<epoch>.<number>`).
    pub(super) number: Option<u64>,
}

/// One decision as the feed tells it. Nothing secret: the caller is named by its access key
/// id, never by a secret or a route caller's credentials.
#[derive(Debug, Clone, Serialize)]
pub struct DecisionEvent<'a> {
    pub time_ms: u64,
    pub replica: &'a str,
    pub operation: &'static str,
    pub resource: Option<&'a str>,
    /// What the request named when no resource was (a refusal for a missing token, say).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub object: Option<&'a str>,
    /// The token presented, if any.
    pub token: Option<u64>,
    /// The resource's fence, when the decision named it (a refusal as stale).
    pub fence: Option<u64>,
    /// `accepted` or `refused`.
    pub decision: &'static str,
    /// What kind: `accepted`, `unchecked`, `replayed`, `stale`, `unregistered`, ...
    pub detail: &'static str,
    /// The refusal's code (`FencingTokenStale`, ...); `None` when accepted.
    pub code: Option<&'static str>,
    pub who: Option<&'a str>,
    /// A refusal's id (the feed's `id:`), in the history only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
}

impl Recorded {
    /// As JSON; `id`: the refusal's event id, when it goes into the history's answer.
    pub(super) fn json(&self, replica: &str, id: Option<String>) -> String {
        let event = DecisionEvent {
            time_ms: self.time_ms,
            replica,
            operation: self.operation,
            resource: self.resource.as_ref().map(ResourceKey::as_str),
            object: self.object.as_deref(),
            token: self.token,
            fence: self.fence,
            decision: self.decision,
            detail: self.detail,
            code: self.code,
            who: self.who.as_deref(),
            id,
        };
        serde_json::to_string(&event).expect("an event serialises")
    }
}

/// When and by whom this replica raised a resource's fence to `token`.
#[derive(Debug, Clone)]
pub struct Advance {
    pub token: u64,
    pub at_ms: u64,
    /// The access key that signed the write or the registration; `None` when unknown.
    pub by: Option<Arc<str>>,
}

/// The history, kept under the feed's lock (refusals are numbered there).
#[derive(Default)]
pub(super) struct Recent {
    pub(super) refused: VecDeque<Recorded>,
    pub(super) accepted: VecDeque<Recorded>,
    advances: HashMap<ResourceKey, Advance>,
}

impl Recent {
    pub(super) fn keep(&mut self, recorded: Recorded) {
        let (list, max) = match recorded.number {
            Some(_) => (&mut self.refused, RECENT_REFUSALS_MAX),
            None => (&mut self.accepted, RECENT_ACCEPTED_MAX),
        };
        if list.len() == max {
            list.pop_front();
        }
        list.push_back(recorded);
    }

    /// This replica raised `resource`'s fence: remembered (the newest only, never a lower token).
    pub(super) fn advanced(&mut self, resource: &ResourceKey, advance: Advance) {
        if self.advances.get(resource).is_some_and(|a| a.token >= advance.token) {
            return;
        }
        if self.advances.len() >= ADVANCES_REMEMBERED_MAX && !self.advances.contains_key(resource) {
            let mut times: Vec<u64> = self.advances.values().map(|a| a.at_ms).collect();
            let (_, median, _) = times.select_nth_unstable(ADVANCES_REMEMBERED_MAX / 2);
            let median = *median;
            self.advances.retain(|_, a| a.at_ms > median);
        }
        self.advances.insert(resource.clone(), advance);
    }

    /// When and by whom this replica raised `resource`'s fence to `token`, if it remembers.
    pub(super) fn advance(&self, resource: &str, token: u64) -> Option<Advance> {
        let resource = ResourceKey::new(resource).ok()?;
        self.advances.get(&resource).filter(|a| a.token == token).cloned()
    }
}
