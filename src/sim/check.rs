//! What a run recorded, and the checkers that judge it: G1 (no admission or grant reads a
//! fence below one already acknowledged), G3 (no write commits at the upstream after a newer
//! token was admitted or registered), and lease tokens unique and increasing.

// Its tests run in every build; outside a simulation build only they use it.
#![cfg_attr(not(feature = "simulation"), allow(dead_code))]

use std::fmt;

/// One thing that happened, at `at` ms from the start, the `seq`th of its run. Order is
/// judged by `seq`: on the paused clock many things happen within one millisecond.
#[derive(Debug, Clone)]
pub struct Record {
    pub at: u64,
    pub seq: u64,
    pub what: Happened,
}

#[derive(Debug, Clone)]
pub enum Happened {
    /// A write was admitted (its permit given) after asking at `started` ms, when `asked`
    /// records had been made; `durable` is the fence the store held then.
    Admitted {
        write: u64,
        token: u64,
        replica: usize,
        started: u64,
        asked: u64,
        durable: Option<u64>,
    },
    Refused {
        write: u64,
        token: u64,
        replica: usize,
        why: String,
    },
    /// Its whole body reached the upstream.
    HandedOver {
        write: u64,
        token: u64,
    },
    CutOff {
        write: u64,
        token: u64,
    },
    Answered {
        write: u64,
        token: u64,
        outcome: String,
    },
    Committed {
        write: u64,
        token: u64,
        object: u8,
    },
    /// A registration (or the operator's raise) returned: the fence is now at least `fence`,
    /// and `raised` says it was this call's token.
    Registered {
        token: u64,
        fence: u64,
        raised: bool,
        started: u64,
        asked: u64,
        by: String,
    },
    Granted {
        token: u64,
        replica: usize,
        started: u64,
        asked: u64,
    },
    /// The store lost its state (flushed, restarted empty): what it had acknowledged is gone
    /// by the fault's own nature. `remembered`: every replica lives through it and has made
    /// every call it acknowledged, so their marks still hold the fences (one replica, never
    /// restarted after); otherwise only the quiet period is judged after it.
    StoreLostState {
        remembered: bool,
    },
    /// The run's end: the store's fence then.
    End {
        fence: Option<u64>,
    },
    /// A fault, an operator's action, or anything else worth reading in a history.
    Note(String),
}

impl fmt::Display for Record {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:>6} ms  ", self.at)?;
        match &self.what {
            Happened::Admitted { write, token, replica, started, durable, .. } => write!(
                f,
                "write {write} token {token} admitted on replica {replica} (asked at {started}; the store's fence \
                 {})",
                durable.map_or("none".to_owned(), |fence| fence.to_string())
            ),
            Happened::Refused { write, token, replica, why } => {
                write!(f, "write {write} token {token} refused on replica {replica}: {why}")
            }
            Happened::HandedOver { write, token } => write!(f, "write {write} token {token} handed over"),
            Happened::CutOff { write, token } => write!(f, "write {write} token {token} cut off"),
            Happened::Answered { write, token, outcome } => write!(f, "write {write} token {token}: {outcome}"),
            Happened::Committed { write, token, object } => {
                write!(f, "UPSTREAM COMMITS write {write} token {token} on object {object}")
            }
            Happened::Registered { token, fence, raised, started, by, .. } => {
                write!(f, "{by} registered token {token}: fence {fence} (raised: {raised}, asked at {started})")
            }
            Happened::Granted { token, replica, started, .. } => {
                write!(f, "lease granted with token {token} on replica {replica} (asked at {started})")
            }
            Happened::StoreLostState { remembered } => write!(
                f,
                "the store lost its state (flushed){}",
                if *remembered { "" } else { "; from here the checkers judge only the quiet period" }
            ),
            Happened::End { fence } => {
                write!(f, "end: the store's fence is {}", fence.map_or("none".to_owned(), |fence| fence.to_string()))
            }
            Happened::Note(note) => write!(f, "{note}"),
        }
    }
}

/// A checker's finding: what broke, and the records it rests on.
#[derive(Debug, Clone)]
pub struct Violation {
    pub what: String,
    /// The writes and tokens involved, to cut the history down to them.
    pub writes: Vec<u64>,
    pub tokens: Vec<u64>,
}

/// Every checker over one run's records.
pub fn check(records: &[Record]) -> Vec<Violation> {
    let loss = unremembered_loss(records);
    let mut found = commit_order(records, loss);
    found.extend(acknowledged(records, loss));
    if !records.iter().any(|r| matches!(r.what, Happened::StoreLostState { .. })) {
        found.extend(durable(records));
    }
    found
}

/// G2 and nothing acknowledged lost, on a store that kept its state: a write is admitted only
/// once its token is the store's fence (durable before it is forwarded), and the store ends at
/// or above every fence acknowledged.
fn durable(records: &[Record]) -> Vec<Violation> {
    let mut found = Vec::new();
    let mut acknowledged = None;
    for r in records {
        match &r.what {
            Happened::Admitted { write, token, durable, .. } => {
                if durable.is_none_or(|fence| fence < *token) {
                    found.push(Violation {
                        what: format!(
                            "G2: write {write} with token {token} admitted at {} ms while the store's fence was {durable:?}",
                            r.at
                        ),
                        writes: vec![*write],
                        tokens: vec![*token],
                    });
                }
                acknowledged = acknowledged.max(Some(*token));
            }
            Happened::Registered { fence, .. } => acknowledged = acknowledged.max(Some(*fence)),
            Happened::Granted { token, .. } => acknowledged = acknowledged.max(Some(*token)),
            Happened::End { fence } if *fence < acknowledged => found.push(Violation {
                what: format!("lost: the store ends at {fence:?}, below the acknowledged fence {acknowledged:?}"),
                writes: Vec::new(),
                tokens: acknowledged.into_iter().collect(),
            }),
            _ => {}
        }
    }
    found
}

/// Where the store lost its state with a replica that cannot remember what it held (several
/// replicas, or one restarted since): the seq from which only the quiet period is judged. The
/// fence may go back there (G1 and the cross-object order rest on the replicas' marks and the
/// objects' stamps then: docs/design.md section 6), but no write admitted before the loss may
/// commit after a newer token is admitted.
fn unremembered_loss(records: &[Record]) -> Option<u64> {
    records.iter().find_map(|r| match r.what {
        Happened::StoreLostState { remembered: false } => Some(r.seq),
        _ => None,
    })
}

/// G3: a write with token `c` handed over or committed at the upstream after a write with a
/// newer token was admitted, or a newer token registered (both answer only once older writes
/// are resolved: cut off if their body was not handed over, awaited if it was).
fn commit_order(records: &[Record], loss: Option<u64>) -> Vec<Violation> {
    let mut found = Vec::new();
    let mut admitted_at: std::collections::BTreeMap<u64, u64> = std::collections::BTreeMap::new();
    let mut newer: Vec<(u64, u64, u64, Option<u64>)> = Vec::new();
    for r in records {
        match &r.what {
            Happened::Admitted { token, write, .. } => {
                admitted_at.insert(*write, r.seq);
                newer.push((r.seq, r.at, *token, Some(*write)));
            }
            Happened::Registered { fence, raised: true, .. } => newer.push((r.seq, r.at, *fence, None)),
            _ => {}
        }
    }
    for r in records {
        let (write, token, what) = match &r.what {
            Happened::Committed { write, token, object } => (*write, *token, format!("committed on object {object}")),
            Happened::HandedOver { write, token } => (*write, *token, "handed over".to_owned()),
            _ => continue,
        };
        if loss.is_some_and(|loss| admitted_at.get(&write).is_none_or(|seq| *seq > loss)) {
            continue;
        }
        let first = newer.iter().find(|(seq, _, newer_token, _)| *newer_token > token && *seq < r.seq);
        if let Some(&(_, at, newer_token, newer_write)) = first {
            found.push(Violation {
                what: format!(
                    "G3: write {write} with token {token} {what} at {} ms, after token {newer_token} was {} at {at} ms",
                    r.at,
                    if newer_write.is_some() { "admitted" } else { "registered" }
                ),
                writes: [Some(write), newer_write].into_iter().flatten().collect(),
                tokens: vec![token, newer_token],
            });
            break;
        }
    }
    found
}

/// G1 and leases: an admission, registration or grant asked after a fence was acknowledged
/// never answers below it; a grant is above every token acknowledged before it was asked, and
/// no two grants share a token. Not judged for what was asked after a loss no replica
/// remembers.
fn acknowledged(records: &[Record], loss: Option<u64>) -> Vec<Violation> {
    let mut found = Vec::new();
    // (the record that acknowledged it, the fence it shows)
    let mut acks: Vec<(u64, u64)> = Vec::new();
    let mut granted: Vec<u64> = Vec::new();
    for r in records {
        let (token, started, asked, grant) = match &r.what {
            Happened::Admitted { token, started, asked, .. } => (*token, *started, *asked, false),
            Happened::Registered { fence, raised: true, started, asked, .. } => (*fence, *started, *asked, false),
            Happened::Registered { fence, raised: false, .. } => {
                acks.push((r.seq, *fence));
                continue;
            }
            Happened::Granted { token, started, asked, .. } => (*token, *started, *asked, true),
            _ => continue,
        };
        if loss.is_some_and(|loss| asked > loss) {
            continue;
        }
        let before = acks.iter().filter(|(seq, _)| *seq < asked).map(|(_, fence)| *fence).max();
        if let Some(before) = before
            && (token < before || (grant && token == before))
        {
            found.push(Violation {
                what: format!(
                    "G1: {} token {token} at {} ms, asked at {started} ms, after the fence {before} was acknowledged",
                    if grant { "a lease granted" } else { "admitted" },
                    r.at
                ),
                writes: Vec::new(),
                tokens: vec![token, before],
            });
        }
        if grant {
            if granted.contains(&token) {
                found.push(Violation {
                    what: format!("lease token {token} granted twice (again at {} ms)", r.at),
                    writes: Vec::new(),
                    tokens: vec![token],
                });
            }
            granted.push(token);
        }
        acks.push((r.seq, token));
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record at `at` ms, in that order (a test's records are one per ms).
    fn at(at: u64, what: Happened) -> Record {
        Record { at, seq: at, what }
    }

    /// An older commit after a newer admission is G3's violation; one before it, or at the
    /// same token, is not.
    #[test]
    fn a_commit_after_a_newer_admission_is_found() {
        let admitted =
            |t, w| Happened::Admitted { write: w, token: t, replica: 0, started: 0, asked: 0, durable: Some(t) };
        let committed = |t, w| Happened::Committed { write: w, token: t, object: 0 };
        assert!(check(&[at(10, admitted(1, 1)), at(20, admitted(2, 2)), at(30, committed(1, 1))]).len() == 1);
        assert!(check(&[at(10, admitted(1, 1)), at(20, committed(1, 1)), at(30, admitted(2, 2))]).is_empty());
        assert!(check(&[at(10, admitted(2, 1)), at(20, admitted(2, 2)), at(30, committed(2, 1))]).is_empty());
        let handed = |t, w| Happened::HandedOver { write: w, token: t };
        assert_eq!(check(&[at(10, admitted(1, 1)), at(20, admitted(2, 2)), at(30, handed(1, 1))]).len(), 1);
    }

    /// After a loss no replica remembers, an older write admitted before it still may not
    /// commit after a newer admission; what is admitted after it is the stated limit.
    #[test]
    fn after_an_unremembered_loss_only_the_quiet_period_is_judged() {
        let admitted =
            |t, w| Happened::Admitted { write: w, token: t, replica: 0, started: 0, asked: 0, durable: Some(t) };
        let committed = |t, w| Happened::Committed { write: w, token: t, object: 0 };
        let loss = || Happened::StoreLostState { remembered: false };
        let before = [at(10, admitted(2, 1)), at(20, loss()), at(30, admitted(3, 2)), at(40, committed(2, 1))];
        assert_eq!(check(&before).len(), 1);
        let after = [
            at(10, admitted(3, 1)),
            at(20, loss()),
            at(30, admitted(2, 2)),
            at(40, admitted(3, 3)),
            at(50, committed(2, 2)),
        ];
        assert!(check(&after).is_empty());
    }

    /// An admission asked after a higher fence was acknowledged is G1's violation; a grant at
    /// an acknowledged token, or twice the same, is the lease checker's.
    #[test]
    fn an_admission_below_an_acknowledged_fence_is_found() {
        let admitted = |t, started| Happened::Admitted {
            write: t,
            token: t,
            replica: 0,
            started,
            asked: started,
            durable: Some(t),
        };
        assert_eq!(check(&[at(10, admitted(5, 0)), at(30, admitted(4, 20))]).len(), 1);
        assert!(check(&[at(10, admitted(5, 0)), at(30, admitted(4, 5))]).is_empty(), "asked before the ack");
        let granted = |t, started| Happened::Granted { token: t, replica: 0, started, asked: started };
        assert_eq!(check(&[at(10, admitted(5, 0)), at(30, granted(5, 20))]).len(), 1);
        assert_eq!(check(&[at(10, granted(5, 0)), at(30, granted(5, 5))]).len(), 1);
        assert!(check(&[at(10, granted(5, 0)), at(30, granted(6, 20))]).is_empty());
    }

    /// An admission above the store's fence, or a store that ends below what it acknowledged,
    /// is found unless the store lost its state.
    #[test]
    fn an_advance_not_durable_or_lost_is_found() {
        let admitted = |durable| Happened::Admitted { write: 1, token: 5, replica: 0, started: 0, asked: 0, durable };
        assert_eq!(check(&[at(10, admitted(Some(4)))]).len(), 1);
        assert_eq!(check(&[at(10, admitted(Some(5))), at(20, Happened::End { fence: Some(4) })]).len(), 1);
        assert!(check(&[at(10, admitted(Some(5))), at(20, Happened::End { fence: Some(5) })]).is_empty());
        let lost = [
            at(5, Happened::StoreLostState { remembered: true }),
            at(10, admitted(None)),
            at(20, Happened::End { fence: None }),
        ];
        assert!(check(&lost).is_empty());
    }
}
