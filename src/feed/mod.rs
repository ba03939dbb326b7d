//! Every write decision, recorded once per request ([`Decision`]): the request span's
//! `decision` field, the `fencegate_decisions_total` counter, the feed's bounded history of
//! recent decisions (`recent.rs`, `GET /v1/decisions`: a console opened later still shows a
//! refusal), and, while an operator watches, an event on the feed ([`Feed`], `GET /v1/events`
//! on the admin listener).
//!
//! While nobody watches, a decision costs its facts (a few words and an access key id) and one
//! push into the history: a refusal always, an acceptance when the lock is free (a write never
//! waits for it); no event is rendered. A watcher that reads
//! slower than decisions are made loses accepted events, counted and told (`dropped`), never a
//! refusal: past [`REFUSALS_QUEUED_MAX`] refusals unread, its feed ends with `overflow` rather
//! than skip one. Refusals are numbered (every one this process made, watched or not), so a
//! watcher that comes back after its feed ended or broke learns how many it missed
//! ([`Missed`]).

mod decision;
mod recent;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

pub use self::decision::Decision;
pub use self::recent::{ADVANCES_REMEMBERED_MAX, Advance, DecisionEvent, RECENT_ACCEPTED_MAX, RECENT_REFUSALS_MAX};
use self::recent::{Recent, Recorded};

use crate::fence::{Clock, SystemClock};
use crate::fence::{FenceToken, ResourceKey};

/// Accepted events kept for a watcher that has not read them; beyond, they are dropped and
/// counted.
pub const ACCEPTED_QUEUED_MAX: usize = 256;

/// Refusals kept for a watcher that has not read them; beyond, its feed ends (`overflow`).
pub const REFUSALS_QUEUED_MAX: usize = 10_000;

/// Watchers at once at most; one more is refused (the admin listener answers 503).
pub const WATCHERS_MAX: usize = 16;
/// Of those, what one client (a peer address) may hold: a few readers that never read cannot
/// take every place.
pub const WATCHERS_PER_CLIENT_MAX: usize = 4;

/// Who opens a watch.
#[derive(Debug, Clone, Default)]
pub struct Viewer {
    /// The client's share key (its peer address); empty when unknown.
    pub client: String,
    /// Presented the admin bearer token: always gets a place, ending another viewer's oldest
    /// watch if it must.
    pub operator: bool,
}

/// Why a watch was not opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WatchRefused {
    /// [`WATCHERS_MAX`] watch, none of them ends for this viewer.
    Full,
    /// The client holds [`WATCHERS_PER_CLIENT_MAX`] already.
    ClientFull,
    /// fencegate is stopping.
    Closed,
}

/// What a watcher reads next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FeedItem {
    /// A decision, as JSON; a refusal with its number ([`Feed::refusal_id`]).
    Decision(Arc<str>, Option<u64>),
    /// Accepted events dropped since the last item, because the watcher read too slowly.
    Dropped(u64),
    /// The watcher fell [`REFUSALS_QUEUED_MAX`] refusals behind: its feed ends here.
    Overflow,
}

/// The decisions of this replica, to whoever watches.
pub struct Feed {
    replica: Arc<str>,
    /// Names this process's count of refusals: a watcher's last refusal id from another
    /// process (a restart) tells nothing of what it missed.
    epoch: String,
    watchers: Mutex<Watchers>,
    /// `watchers.len()`, read without the lock on every decision.
    watched: AtomicUsize,
    closed: AtomicBool,
}

#[derive(Default)]
struct Watchers {
    list: Vec<Arc<Watcher>>,
    /// Refusals made so far; counted under the lock that orders their delivery, so every
    /// watcher reads them in the order of their numbers.
    refusals: u64,
    /// The recent decisions, watched or not.
    recent: Recent,
}

/// What a returning watcher missed, from the last refusal id it read (`Last-Event-ID`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Missed {
    /// This many refusals were made after it (0: none).
    Refusals(u64),
    /// The id is of another process, or is no id of this feed: how many is unknown.
    Unknown,
}

#[derive(Default)]
struct Watcher {
    queue: Mutex<Queue>,
    ready: Notify,
    viewer: Viewer,
}

#[derive(Default)]
struct Queue {
    /// Each decision, with its number if it is a refusal.
    items: VecDeque<(Option<u64>, Arc<str>)>,
    accepted: usize,
    refusals: usize,
    dropped: u64,
    /// Why the feed ends, once it does: the rest is read first, then this.
    ended: Option<End>,
    /// The end was read: nothing follows.
    finished: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum End {
    /// The watcher fell behind by too many refusals.
    Overflow,
    /// fencegate is stopping.
    Closed,
}

impl Feed {
    pub fn new(replica: impl Into<Arc<str>>) -> Arc<Self> {
        Arc::new(Self {
            replica: replica.into(),
            epoch: uuid::Uuid::new_v4().simple().to_string()[..12].to_owned(),
            watchers: Mutex::new(Watchers::default()),
            watched: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
        })
    }

    pub fn replica(&self) -> &Arc<str> {
        &self.replica
    }

    /// Whether anyone watches (decisions are then worth describing).
    pub fn watched(&self) -> bool {
        self.watched.load(Ordering::Relaxed) > 0
    }

    /// A new watcher, or `None` when [`WATCHERS_MAX`] already watch or the feed closed. With
    /// `last_seen` (the id of the last refusal a watcher read before, [`Feed::refusal_id`]):
    /// what it missed since, every refusal up to the new watcher's first.
    pub fn watch(self: &Arc<Self>, last_seen: Option<&str>) -> Option<(Watch, Option<Missed>)> {
        self.watch_as(last_seen, Viewer::default()).ok()
    }

    /// [`Feed::watch`] for `viewer`: at most [`WATCHERS_PER_CLIENT_MAX`] per client (the
    /// operator's aside), and an operator finding every place taken ends the oldest watch that
    /// is not an operator's to take its place.
    pub fn watch_as(
        self: &Arc<Self>,
        last_seen: Option<&str>,
        viewer: Viewer,
    ) -> Result<(Watch, Option<Missed>), WatchRefused> {
        let mut watchers = self.watchers.lock().expect("feed lock");
        if self.closed.load(Ordering::Acquire) {
            return Err(WatchRefused::Closed);
        }
        let of_client = |list: &Vec<Arc<Watcher>>| list.iter().filter(|w| w.viewer.client == viewer.client).count();
        if !viewer.operator && !viewer.client.is_empty() && of_client(&watchers.list) >= WATCHERS_PER_CLIENT_MAX {
            return Err(WatchRefused::ClientFull);
        }
        if watchers.list.len() >= WATCHERS_MAX {
            let oldest_other = watchers.list.iter().position(|w| !w.viewer.operator);
            match oldest_other {
                Some(at) if viewer.operator => watchers.list.remove(at).end(End::Closed),
                _ => return Err(WatchRefused::Full),
            }
        }
        let missed = last_seen.map(|id| {
            let seen: Option<u64> =
                id.split_once('.').filter(|(epoch, _)| *epoch == self.epoch).and_then(|(_, n)| n.parse().ok());
            match seen {
                Some(n) if n <= watchers.refusals => Missed::Refusals(watchers.refusals - n),
                _ => Missed::Unknown,
            }
        });
        let watcher = Arc::new(Watcher { viewer, ..Watcher::default() });
        watchers.list.push(watcher.clone());
        self.watched.store(watchers.list.len(), Ordering::Relaxed);
        Ok((Watch { feed: self.clone(), watcher }, missed))
    }

    /// The id of refusal number `n` of this process (`<epoch>.<n>`), as the feed sends it.
    pub fn refusal_id(&self, n: u64) -> String {
        format!("{}.{n}", self.epoch)
    }

    /// Ends every watcher's feed (at shutdown: an open feed would hold the admin listener's
    /// drain for its whole budget).
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        for watcher in self.watchers.lock().expect("feed lock").list.drain(..) {
            watcher.end(End::Closed);
        }
        self.watched.store(0, Ordering::Relaxed);
    }

    /// Keeps the decision `recorded` describes in the history and tells the watchers. A refusal
    /// is numbered, and whether anyone watches is decided, under the lock that queues it: a
    /// watcher that arrives is either counted in by its `missed` or sent the refusal, never
    /// neither. Numbers reach every watcher in order. An accepted decision is queued outside the
    /// lock.
    fn publish(&self, mut recorded: Recorded) {
        if recorded.decision != "refused" {
            return self.publish_accepted(recorded);
        }
        let mut watchers = self.watchers.lock().expect("feed lock");
        watchers.refusals += 1;
        let number = Some(watchers.refusals);
        recorded.number = number;
        if !watchers.list.is_empty() {
            let json: Arc<str> = recorded.json(&self.replica, None).into();
            for watcher in &watchers.list {
                watcher.push(number, json.clone());
            }
        }
        watchers.recent.keep(recorded);
    }

    /// An accepted decision: kept in the history when the lock is free (the history of
    /// acceptances is a sample: a write never waits on the feed), and told to whoever watches.
    fn publish_accepted(&self, recorded: Recorded) {
        let list = match self.watchers.try_lock() {
            Ok(mut watchers) if watchers.list.is_empty() => return watchers.recent.keep(recorded),
            Ok(mut watchers) => {
                watchers.recent.keep(recorded.clone());
                watchers.list.clone()
            }
            Err(std::sync::TryLockError::WouldBlock) if self.watched() => {
                self.watchers.lock().expect("feed lock").list.clone()
            }
            Err(std::sync::TryLockError::WouldBlock) => return,
            Err(std::sync::TryLockError::Poisoned(e)) => panic!("feed lock: {e}"),
        };
        let json: Arc<str> = recorded.json(&self.replica, None).into();
        for watcher in list {
            watcher.push(None, json.clone());
        }
    }

    /// The recent decisions as JSON (`GET /v1/decisions`), oldest first: each refusal with its
    /// event id, so that a page that shows them and then opens the feed from the newest one's id
    /// misses nothing and shows nothing twice.
    pub fn recent_json(&self) -> String {
        // Copied under the lock (shared names, no rendering), rendered after it.
        let (refused, accepted, total) = {
            let watchers = self.watchers.lock().expect("feed lock");
            let recent = &watchers.recent;
            (recent.refused.iter().cloned().collect::<Vec<_>>(), recent.accepted.clone(), watchers.refusals)
        };
        let refused: Vec<String> =
            refused.iter().map(|r| r.json(&self.replica, r.number.map(|n| self.refusal_id(n)))).collect();
        let accepted: Vec<String> = accepted.iter().map(|r| r.json(&self.replica, None)).collect();
        format!(
            "{{\"replica\":{},\"refusals_total\":{total},\"last_id\":{},\"refused\":[{}],\"accepted\":[{}]}}",
            serde_json::to_string(&*self.replica).expect("a name serialises"),
            serde_json::to_string(&self.refusal_id(total)).expect("an id serialises"),
            refused.join(","),
            accepted.join(",")
        )
    }

    /// This replica raised `resource`'s fence to `token`, for `by` (an access key id).
    /// Kept when the lock is free: a write never waits for the feed.
    pub fn note_advance(&self, resource: &ResourceKey, token: FenceToken, by: Option<Arc<str>>) {
        let advance = Advance { token: token.0, at_ms: SystemClock.now_ms(), by };
        if let Ok(mut watchers) = self.watchers.try_lock() {
            watchers.recent.advanced(resource, advance);
        }
    }

    /// When and by whom this replica raised `resource`'s fence to `token`, if it remembers.
    pub fn advance(&self, resource: &str, token: u64) -> Option<Advance> {
        self.watchers.lock().expect("feed lock").recent.advance(resource, token)
    }

    fn forget(&self, watcher: &Arc<Watcher>) {
        let mut watchers = self.watchers.lock().expect("feed lock");
        watchers.list.retain(|w| !Arc::ptr_eq(w, watcher));
        self.watched.store(watchers.list.len(), Ordering::Relaxed);
    }
}

impl Watcher {
    fn push(&self, refusal: Option<u64>, json: Arc<str>) {
        let mut queue = self.queue.lock().expect("feed lock");
        if queue.ended.is_some() {
            return;
        }
        if refusal.is_some() {
            if queue.refusals == REFUSALS_QUEUED_MAX {
                queue.ended = Some(End::Overflow);
                drop(queue);
                self.ready.notify_one();
                return;
            }
            queue.refusals += 1;
        } else {
            if queue.accepted == ACCEPTED_QUEUED_MAX {
                queue.dropped += 1;
                return;
            }
            queue.accepted += 1;
        }
        queue.items.push_back((refusal, json));
        drop(queue);
        self.ready.notify_one();
    }

    fn end(&self, end: End) {
        let mut queue = self.queue.lock().expect("feed lock");
        if end == End::Closed {
            // At shutdown nothing more is read: the feed just ends.
            queue.items.clear();
            queue.dropped = 0;
        }
        queue.ended.get_or_insert(end);
        drop(queue);
        self.ready.notify_one();
    }
}

/// One watcher of the feed; it stops watching when dropped (its client went away).
pub struct Watch {
    feed: Arc<Feed>,
    watcher: Arc<Watcher>,
}

impl Watch {
    /// The next item; `None` once the feed ended (after [`FeedItem::Overflow`], or at
    /// shutdown).
    pub async fn next(&mut self) -> Option<FeedItem> {
        loop {
            let notified = self.watcher.ready.notified();
            {
                let mut queue = self.watcher.queue.lock().expect("feed lock");
                if queue.dropped > 0 {
                    return Some(FeedItem::Dropped(std::mem::take(&mut queue.dropped)));
                }
                if let Some((refusal, json)) = queue.items.pop_front() {
                    if refusal.is_some() {
                        queue.refusals -= 1;
                    } else {
                        queue.accepted -= 1;
                    }
                    return Some(FeedItem::Decision(json, refusal));
                }
                if queue.finished {
                    return None;
                }
                if let Some(end) = queue.ended {
                    queue.finished = true;
                    return (end == End::Overflow).then_some(FeedItem::Overflow);
                }
            }
            notified.await;
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.feed.forget(&self.watcher);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decision(feed: &Arc<Feed>, resource: &str, token: u64) -> Arc<Decision> {
        let decision = Decision::new(feed, tracing::Span::none());
        decision.operation("PutObject");
        decision.write(&ResourceKey::new(resource).unwrap(), FenceToken(token));
        decision
    }

    /// Everything a watcher has been told, up to the first pause.
    async fn drain(watch: &mut Watch) -> Vec<FeedItem> {
        let mut items = Vec::new();
        while let Ok(Some(item)) = tokio::time::timeout(std::time::Duration::from_millis(50), watch.next()).await {
            items.push(item);
        }
        items
    }

    fn is_refusal(item: &FeedItem) -> bool {
        matches!(item, FeedItem::Decision(json, _) if json.contains("\"decision\":\"refused\""))
    }

    #[tokio::test]
    async fn a_slow_watcher_loses_accepted_events_counted_and_never_a_refusal() {
        let feed = Feed::new("r1");
        let mut watch = feed.watch(None).unwrap().0;
        for n in 0..600u64 {
            let d = decision(&feed, "job:a", n);
            if n % 6 == 0 {
                d.refused("stale", "FencingTokenStale", Some(FenceToken(1000)), true, &"stale");
            } else {
                d.let_through("accepted");
            }
        }
        let items = drain(&mut watch).await;
        let refusals = items.iter().filter(|i| is_refusal(i)).count();
        let accepted = items.iter().filter(|i| matches!(i, FeedItem::Decision(..)) && !is_refusal(i)).count();
        let dropped: u64 = items.iter().map(|i| if let FeedItem::Dropped(n) = i { *n } else { 0 }).sum();
        assert_eq!(refusals, 100, "every refusal");
        assert_eq!(accepted, ACCEPTED_QUEUED_MAX, "accepted events up to the queue");
        assert_eq!(accepted as u64 + dropped, 500, "the rest counted as dropped");
        assert!(matches!(items[0], FeedItem::Dropped(_)), "the loss is told first");
    }

    #[tokio::test]
    async fn a_watcher_too_far_behind_on_refusals_is_ended_not_skipped() {
        let feed = Feed::new("r1");
        let mut watch = feed.watch(None).unwrap().0;
        for n in 0..=REFUSALS_QUEUED_MAX as u64 {
            decision(&feed, "job:a", n).refused("stale", "FencingTokenStale", None, false, &"stale");
        }
        let mut refusals = 0;
        loop {
            match watch.next().await {
                Some(FeedItem::Decision(..)) => refusals += 1,
                Some(FeedItem::Overflow) => break,
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(refusals, REFUSALS_QUEUED_MAX);
        assert_eq!(watch.next().await, None, "nothing after the overflow");
    }

    #[tokio::test]
    async fn each_request_tells_its_decision_once() {
        let feed = Feed::new("r1");
        let mut watch = feed.watch(None).unwrap().0;
        let d = decision(&feed, "job:a", 7);
        d.who("AKIDEXAMPLE");
        d.let_through("accepted");
        d.let_through("accepted");
        d.refused("error", "UpstreamTimeout", None, true, &"timeout");
        d.refused("stale", "FencingTokenStale", Some(FenceToken(9)), true, &"a newer stamp");
        let items = drain(&mut watch).await;
        assert_eq!(items.len(), 2, "{items:?}");
        let FeedItem::Decision(first, None) = &items[0] else { panic!() };
        let first: serde_json::Value = serde_json::from_str(first).unwrap();
        assert_eq!(first["decision"], "accepted");
        assert_eq!((first["resource"].as_str(), first["token"].as_u64()), (Some("job:a"), Some(7)));
        assert_eq!((first["replica"].as_str(), first["who"].as_str()), (Some("r1"), Some("AKIDEXAMPLE")));
        assert_eq!(first["operation"], "PutObject");
        assert!(is_refusal(&items[1]), "a refusal after admission is a decision of its own");
    }

    #[tokio::test]
    async fn watchers_are_bounded_and_end_at_close() {
        let feed = Feed::new("r1");
        assert!(!feed.watched());
        let mut watches: Vec<Watch> = (0..WATCHERS_MAX).map(|_| feed.watch(None).unwrap().0).collect();
        assert!(feed.watch(None).is_none(), "one more is refused");
        drop(watches.pop());
        let mut last = feed.watch(None).expect("a place freed").0;
        decision(&feed, "job:a", 1).let_through("accepted");
        feed.close();
        assert_eq!(last.next().await, None, "the feed ends at shutdown");
        assert!(feed.watch(None).is_none() && !feed.watched());
    }

    /// A client holds a few watches at most; an operator always gets one, ending the oldest
    /// watch that is not an operator's; operators alone fill the feed only among themselves.
    #[tokio::test]
    async fn a_client_holds_a_few_watches_and_the_operator_always_gets_one() {
        let feed = Feed::new("r1");
        let viewer = |client: &str, operator| Viewer { client: client.into(), operator };
        let mut held = Vec::new();
        for _ in 0..WATCHERS_PER_CLIENT_MAX {
            held.push(feed.watch_as(None, viewer("10.0.0.1", false)).unwrap().0);
        }
        assert_eq!(feed.watch_as(None, viewer("10.0.0.1", false)).err(), Some(WatchRefused::ClientFull));
        for i in 0..(WATCHERS_MAX - WATCHERS_PER_CLIENT_MAX) {
            held.push(feed.watch_as(None, viewer(&format!("10.0.1.{i}"), false)).unwrap().0);
        }
        assert_eq!(feed.watch_as(None, viewer("10.0.2.1", false)).err(), Some(WatchRefused::Full));
        let operator = feed.watch_as(None, viewer("10.0.0.1", true)).expect("the operator gets a place").0;
        assert_eq!(held[0].next().await, None, "the oldest other watch ended for it");
        drop(operator);
        assert!(feed.watch_as(None, viewer("10.0.2.1", false)).is_ok(), "a place freed");
    }

    /// Refusals are numbered whether watched or not, in the order every watcher reads them; a
    /// watcher back with the id of the last one it read learns how many it missed, and an id
    /// of another process (or none of this feed's) says that is unknown.
    #[tokio::test]
    async fn a_returning_watcher_learns_how_many_refusals_it_missed() {
        let feed = Feed::new("r1");
        let refuse = |n| decision(&feed, "job:a", n).refused("stale", "FencingTokenStale", None, true, &"stale");
        (0..3).for_each(refuse);
        let (mut watch, missed) = feed.watch(None).unwrap();
        assert_eq!(missed, None, "a first watcher asks nothing");
        refuse(3);
        decision(&feed, "job:a", 4).let_through("accepted");
        refuse(5);
        let ids: Vec<Option<u64>> = drain(&mut watch)
            .await
            .iter()
            .map(|i| if let FeedItem::Decision(_, id) = i { *id } else { None })
            .collect();
        assert_eq!(ids, [Some(4), None, Some(5)], "refusals carry their numbers, accepted events none");
        drop(watch);
        (6..9).for_each(refuse);
        decision(&feed, "job:a", 9).let_through("accepted");
        let back = |id: &str| feed.watch(Some(id)).unwrap().1;
        assert_eq!(back(&feed.refusal_id(5)), Some(Missed::Refusals(3)));
        assert_eq!(back(&feed.refusal_id(8)), Some(Missed::Refusals(0)));
        for other in ["0123456789ab.5", &feed.refusal_id(9), "garbage", ""] {
            assert_eq!(back(other), Some(Missed::Unknown), "{other:?}");
        }
    }

    /// Refusals made on other threads while watchers come and go: every watcher's first
    /// refusal is the one right after those its `missed` counted, so none is neither delivered
    /// nor counted (a refusal once checked "watched?" outside the lock that numbers it).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_refusal_falls_between_a_watcher_and_its_missed_count() {
        let feed = Feed::new("r1");
        let stop = Arc::new(AtomicBool::new(false));
        let refusing = {
            let (feed, stop) = (feed.clone(), stop.clone());
            std::thread::spawn(move || {
                for n in 0..2_000_000u64 {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    decision(&feed, "job:a", n).refused("stale", "FencingTokenStale", None, true, &"stale");
                }
            })
        };
        let (mut last, mut delivered) = (0u64, 0);
        for _ in 0..200 {
            let (mut watch, missed) = feed.watch(Some(&feed.refusal_id(last))).unwrap();
            let Some(Missed::Refusals(missed)) = missed else { panic!("{missed:?}") };
            let expected_first = last + missed + 1;
            last = expected_first - 1;
            let mut first = true;
            for _ in 0..50 {
                let Ok(Some(item)) = tokio::time::timeout(std::time::Duration::from_millis(1), watch.next()).await
                else {
                    break;
                };
                if let FeedItem::Decision(_, Some(n)) = item {
                    if first {
                        assert_eq!(n, expected_first, "a refusal neither delivered nor counted");
                        first = false;
                    }
                    assert!(n > last, "in order");
                    (last, delivered) = (n, delivered + 1);
                }
            }
        }
        assert!(delivered > 0, "the test saw refusals delivered");
        stop.store(true, Ordering::Relaxed);
        refusing.join().unwrap();
    }

    /// Decisions made while nobody watched are kept: refusals up to their bound, longer than
    /// acceptances, each with its id, and what a refusal named when no resource was.
    #[test]
    fn the_history_keeps_recent_decisions_watched_or_not() {
        let feed = Feed::new("replica-a");
        assert!(!feed.watched());
        let d = decision(&feed, "job:a", 5);
        d.who("AKID");
        d.let_through("accepted");
        let early = Decision::new(&feed, tracing::Span::none());
        early.operation("PutObject");
        early.object("bucket/key");
        early.refused("missing", "FencingTokenRequired", None, true, &"no token");
        for n in 0..(RECENT_REFUSALS_MAX as u64 + 10) {
            decision(&feed, "job:a", n).refused("stale", "FencingTokenStale", Some(FenceToken(5)), true, &"stale");
        }
        for n in 0..(RECENT_ACCEPTED_MAX as u64 + 10) {
            decision(&feed, "job:b", 100 + n).let_through("accepted");
        }
        let recent: serde_json::Value = serde_json::from_str(&feed.recent_json()).unwrap();
        let refused = recent["refused"].as_array().unwrap();
        assert_eq!(refused.len(), RECENT_REFUSALS_MAX);
        assert_eq!(recent["accepted"].as_array().unwrap().len(), RECENT_ACCEPTED_MAX);
        assert_eq!(recent["refusals_total"], RECENT_REFUSALS_MAX as u64 + 11);
        let newest = refused.last().unwrap();
        assert_eq!(newest["id"], feed.refusal_id(RECENT_REFUSALS_MAX as u64 + 11));
        assert_eq!(
            (newest["resource"].as_str(), newest["token"].as_u64()),
            (Some("job:a"), Some(RECENT_REFUSALS_MAX as u64 + 9))
        );
        // The oldest went first: the refusal without a resource is past the bound now.
        assert!(refused.iter().all(|r| r["code"] == "FencingTokenStale"));

        let feed = Feed::new("replica-b");
        early_refusal_named(&feed);
        let recent: serde_json::Value = serde_json::from_str(&feed.recent_json()).unwrap();
        assert_eq!(recent["refused"][0]["object"], "bucket/key");
        assert_eq!(recent["refused"][0]["resource"], serde_json::Value::Null);
    }

    fn early_refusal_named(feed: &Arc<Feed>) {
        let early = Decision::new(feed, tracing::Span::none());
        early.operation("PutObject");
        early.object("bucket/key");
        early.refused("missing", "FencingTokenRequired", None, true, &"no token");
    }

    /// An advance is remembered with when and by whom, the newest only.
    #[test]
    fn a_fence_remembers_who_last_raised_it() {
        let feed = Feed::new("replica-a");
        let by = |who: &str, token: u64| {
            let d = decision(&feed, "job:a", token);
            d.who(who);
            d.advanced();
            d.let_through("accepted");
        };
        by("first", 3);
        by("older", 2);
        let advance = feed.advance("job:a", 3).expect("remembered");
        assert_eq!((advance.token, advance.by.as_deref()), (3, Some("first")));
        assert!(feed.advance("job:a", 2).is_none(), "only the newest token is remembered");
        by("newer", 4);
        assert_eq!(feed.advance("job:a", 4).unwrap().by.as_deref(), Some("newer"));
        assert!(feed.advance("job:a", 3).is_none());
        assert!(feed.advance("job:b", 4).is_none());
        let plain = decision(&feed, "job:c", 9);
        plain.let_through("accepted");
        assert!(feed.advance("job:c", 9).is_none(), "a write that did not advance tells no advance");
    }
}
