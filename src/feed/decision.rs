//! One request's decision, recorded once: on its span, in `fencegate_decisions_total`, and on
//! the operator's feed.

use super::*;

/// What a refusal's `object` keeps of the name a request gave (an S3 key is at most 1,024 bytes;
/// a longer name is cut).
pub const OBJECT_BYTES_MAX: usize = 1024;

/// One request's decision, recorded once. Cheap to share with the task that admits the write.
pub struct Decision {
    feed: Arc<Feed>,
    span: tracing::Span,
    decided: AtomicBool,
    /// What the feed's event says of the request (the feed keeps recent decisions whether
    /// anyone watches or not).
    facts: Mutex<Facts>,
}

#[derive(Default, Clone)]
struct Facts {
    operation: &'static str,
    resource: Option<ResourceKey>,
    object: Option<Arc<str>>,
    token: Option<u64>,
    who: Option<Arc<str>>,
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
        self.facts.lock().expect("decision lock").operation = name;
    }

    /// Who asked: an access key id (never a secret).
    pub fn who(&self, who: &str) {
        self.facts.lock().expect("decision lock").who = Some(who.into());
    }

    /// The resource written and the token presented.
    pub fn write(&self, resource: &ResourceKey, token: FenceToken) {
        self.span.record("resource", resource.as_str());
        self.span.record("token", token.0);
        let mut facts = self.facts.lock().expect("decision lock");
        facts.resource = Some(resource.clone());
        facts.token = Some(token.0);
    }

    /// The admission raised the resource's fence to the request's token: the feed remembers
    /// when and by whom (the console's fences).
    pub fn advanced(&self) {
        let facts = self.facts.lock().expect("decision lock");
        if let (Some(resource), Some(token)) = (&facts.resource, facts.token) {
            self.feed.note_advance(resource, FenceToken(token), facts.who.clone());
        }
    }

    /// One key's admission raised its resource's fence (DeleteObjects).
    pub fn key_advanced(&self, resource: &ResourceKey, token: FenceToken) {
        let who = self.facts.lock().expect("decision lock").who.clone();
        self.feed.note_advance(resource, token, who);
    }

    /// Whether a resource was named ([`Decision::write`]).
    pub fn names_resource(&self) -> bool {
        self.facts.lock().expect("decision lock").resource.is_some()
    }

    /// What the request named (`bucket/key`, a path), for a refusal made before any resource
    /// was: the operator looks for the client by it.
    /// Cut to [`OBJECT_BYTES_MAX`] (on a character boundary, marked `…`): a key or path is
    /// the caller's, and the history keeps a thousand refusals.
    pub fn object(&self, name: &str) {
        let name: Arc<str> = if name.len() <= OBJECT_BYTES_MAX {
            name.into()
        } else {
            let cut = name.floor_char_boundary(OBJECT_BYTES_MAX);
            format!("{}…", &name[..cut]).into()
        };
        self.facts.lock().expect("decision lock").object = Some(name);
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

    /// Keeps the decision in the feed's history and sends it to whoever watches; `write`: the
    /// resource and token of one key's decision, when they are not the request's.
    fn tell(
        &self,
        decision: &'static str,
        detail: &'static str,
        code: Option<&'static str>,
        fence: Option<FenceToken>,
        write: Option<(&ResourceKey, FenceToken)>,
    ) {
        let facts = self.facts.lock().expect("decision lock").clone();
        let (resource, token) = match write {
            Some((resource, token)) => (Some(resource.clone()), Some(token.0)),
            None => (facts.resource, facts.token),
        };
        self.feed.publish(Recorded {
            time_ms: SystemClock.now_ms(),
            operation: facts.operation,
            object: facts.object.filter(|_| resource.is_none()),
            resource,
            token,
            fence: fence.map(|f| f.0),
            decision,
            detail,
            code,
            who: facts.who,
            number: None,
        });
    }
}
