//! One request's decision, recorded once: on its span, in `fencegate_decisions_total`, and on
//! the operator's feed.

use super::*;

/// One request's decision, recorded once. Cheap to share with the task that admits the write.
pub struct Decision {
    feed: Arc<Feed>,
    span: tracing::Span,
    decided: AtomicBool,
    /// What the feed's event says of the request, kept only while someone watches.
    facts: Mutex<Facts>,
}

#[derive(Default, Clone)]
struct Facts {
    operation: &'static str,
    resource: Option<String>,
    token: Option<u64>,
    who: Option<String>,
}

impl Decision {
    pub fn new(feed: &Arc<Feed>, span: tracing::Span) -> Arc<Self> {
        Arc::new(Self {
            feed: feed.clone(),
            span,
            decided: AtomicBool::new(false),
            facts: Mutex::new(Facts::default()),
        })
    }

    pub fn span(&self) -> &tracing::Span {
        &self.span
    }

    /// The operation (`PutObject`, a route's method...), also the span's `op` when it has one.
    pub fn operation(&self, name: &'static str) {
        self.span.record("op", name);
        if self.feed.watched() {
            self.facts.lock().expect("decision lock").operation = name;
        }
    }

    /// Who asked: an access key id (never a secret).
    pub fn who(&self, who: &str) {
        if self.feed.watched() {
            self.facts.lock().expect("decision lock").who = Some(who.to_owned());
        }
    }

    /// The resource written and the token presented.
    pub fn write(&self, resource: &ResourceKey, token: FenceToken) {
        self.span.record("resource", resource.as_str());
        self.span.record("token", token.0);
        if self.feed.watched() {
            let mut facts = self.facts.lock().expect("decision lock");
            facts.resource = Some(resource.as_str().to_owned());
            facts.token = Some(token.0);
        }
    }

    /// The write was let through: `accepted` (admitted by the gate), `unchecked` (no token,
    /// none required), `replayed` (an idempotency record answered), `own_upload_aborted`.
    pub fn let_through(&self, detail: &'static str) {
        if self.decided.swap(true, Ordering::AcqRel) {
            return;
        }
        if detail != "replayed" && detail != "own_upload_aborted" {
            crate::metrics::decision(detail);
        }
        self.span.record("decision", detail);
        self.publish("accepted", detail, None, None);
    }

    /// The request failed: refused by the fencing protocol, or an error after admission
    /// (`decision` is then `error`). The first decision names the span's; each is logged.
    /// `counted`: whether it counts in the decisions counter (a read refused is no write
    /// decision).
    pub fn refused(
        &self,
        decision: &'static str,
        code: &'static str,
        fence: Option<FenceToken>,
        counted: bool,
        error: &dyn std::fmt::Display,
    ) {
        if counted && decision != "error" {
            crate::metrics::decision(decision);
        }
        if let Some(current) = fence {
            self.span.record("fence", current.0);
        }
        // A refusal after admission (a newer stamp found on the object) is a decision of its
        // own; an error after admission is no decision, only the write's outcome.
        let first = !self.decided.swap(true, Ordering::AcqRel);
        if first {
            self.span.record("decision", decision);
        }
        if first || decision != "error" {
            self.publish("refused", decision, Some(code), fence);
        }
        self.span.in_scope(|| tracing::info!(%error, "refused"));
    }

    /// One key's decision inside a request that decides many (DeleteObjects): counted and
    /// told, the request's own decision left as it is.
    pub fn key_decided(
        &self,
        resource: &ResourceKey,
        token: FenceToken,
        detail: &'static str,
        code: Option<&'static str>,
        fence: Option<FenceToken>,
    ) {
        crate::metrics::decision(detail);
        let decision = if code.is_some() { "refused" } else { "accepted" };
        self.tell(decision, detail, code, fence, Some((resource, token)));
    }

    fn publish(
        &self,
        decision: &'static str,
        detail: &'static str,
        code: Option<&'static str>,
        fence: Option<FenceToken>,
    ) {
        self.tell(decision, detail, code, fence, None);
    }

    /// Sends the event, while someone watches; `write`: the resource and token of one key's
    /// decision, when they are not the request's.
    fn tell(
        &self,
        decision: &'static str,
        detail: &'static str,
        code: Option<&'static str>,
        fence: Option<FenceToken>,
        write: Option<(&ResourceKey, FenceToken)>,
    ) {
        let refusal = decision == "refused";
        let watched = self.feed.watched();
        if !watched && !refusal {
            return;
        }
        // What the request told of itself while watched (a watcher that arrived since gets
        // the refusal with what is known: it is counted all the same).
        let facts = if watched { self.facts.lock().expect("decision lock").clone() } else { Facts::default() };
        let (resource, token) = match write {
            Some((resource, token)) => (Some(resource.as_str()), Some(token.0)),
            None => (facts.resource.as_deref(), facts.token),
        };
        self.feed.publish(refusal, || {
            let event = DecisionEvent {
                time_ms: SystemClock.now_ms(),
                replica: &self.feed.replica,
                operation: facts.operation,
                resource,
                token,
                fence: fence.map(|f| f.0),
                decision,
                detail,
                code,
                who: facts.who.as_deref(),
            };
            serde_json::to_string(&event).expect("an event serialises").into()
        });
    }
}
