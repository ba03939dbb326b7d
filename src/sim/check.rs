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
    let losses = unremembered_losses(records);
    let mut found = commit_order(records, &losses);
    found.extend(acknowledged(records, &losses));
    found.extend(durable(records));
    found
}

/// G2 and nothing acknowledged lost: a write is admitted only once its token is the store's
/// fence (durable before it is forwarded), and the store ends at or above every fence
/// acknowledged. Judged up to the store's first loss of its state (after it the store's fence
/// is what the loss left).
fn durable(records: &[Record]) -> Vec<Violation> {
    let mut found = Vec::new();
    let mut acknowledged = None;
    for r in records {
        match &r.what {
            Happened::StoreLostState { .. } => return found,
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
/// replicas, or one restarted since): the seqs of those losses. The fence may go back at each
/// (G1 and the cross-object order rest on the replicas' marks and the objects' stamps then:
/// docs/design.md section 6), but no write admitted before a loss may commit after a newer
/// token is admitted.
fn unremembered_losses(records: &[Record]) -> Vec<u64> {
    records
        .iter()
        .filter_map(|r| match r.what {
            Happened::StoreLostState { remembered: false } => Some(r.seq),
            _ => None,
        })
        .collect()
}

/// The era of a call asked when `asked` records had been made: how many such losses came
/// before it.
fn era(losses: &[u64], asked: u64) -> usize {
    losses.iter().filter(|loss| **loss < asked).count()
}

/// G3: a write with token `c` handed over or committed at the upstream after a write with a
/// newer token was admitted, or a newer token registered (both answer only once older writes
/// are resolved: cut off if their body was not handed over, awaited if they were). Across a
/// loss no replica remembers, an older write asked after it may follow a newer one asked
/// before it (the fence went back: the stated limit); every other pair is judged.
fn commit_order(records: &[Record], losses: &[u64]) -> Vec<Violation> {
    let mut asked_of: std::collections::BTreeMap<u64, u64> = std::collections::BTreeMap::new();
    // (seq, at, token, write, asked)
    let mut newer: Vec<(u64, u64, u64, Option<u64>, u64)> = Vec::new();
    for r in records {
        match &r.what {
            Happened::Admitted { token, write, asked, .. } => {
                asked_of.insert(*write, *asked);
                newer.push((r.seq, r.at, *token, Some(*write), *asked));
            }
            Happened::Registered { fence, raised: true, asked, .. } => newer.push((r.seq, r.at, *fence, None, *asked)),
            _ => {}
        }
    }
    for r in records {
        let (write, token, what) = match &r.what {
            Happened::Committed { write, token, object } => (*write, *token, format!("committed on object {object}")),
            Happened::HandedOver { write, token } => (*write, *token, "handed over".to_owned()),
            _ => continue,
        };
        let older_era = asked_of.get(&write).map_or(0, |asked| era(losses, *asked));
        let first = newer.iter().find(|(seq, _, newer_token, _, asked)| {
            *newer_token > token && *seq < r.seq && older_era <= era(losses, *asked)
        });
        if let Some(&(_, at, newer_token, newer_write, _)) = first {
            return vec![Violation {
                what: format!(
                    "G3: write {write} with token {token} {what} at {} ms, after token {newer_token} was {} at {at} ms",
                    r.at,
                    if newer_write.is_some() { "admitted" } else { "registered" }
                ),
                writes: [Some(write), newer_write].into_iter().flatten().collect(),
                tokens: vec![token, newer_token],
            }];
        }
    }
    Vec::new()
}

/// G1 and leases: an admission, registration or grant asked after a fence was acknowledged
/// never answers below it; a grant is above every token acknowledged before it was asked, and
/// no two grants share a token. Across a loss no replica remembers, a call is judged against
/// what was acknowledged to calls asked since that loss (the fence may go back below what came
/// before: the stated limit).
fn acknowledged(records: &[Record], losses: &[u64]) -> Vec<Violation> {
    let mut found = Vec::new();
    // (the record that acknowledged it, the fence it shows, the era it was asked in)
    let mut acks: Vec<(u64, u64, usize)> = Vec::new();
    // Tokens granted, with the era they were asked in.
    let mut granted: Vec<(u64, usize)> = Vec::new();
    for r in records {
        let (token, started, asked, grant) = match &r.what {
            Happened::Admitted { token, started, asked, .. } => (*token, *started, *asked, false),
            Happened::Registered { fence, raised: true, started, asked, .. } => (*fence, *started, *asked, false),
            Happened::Registered { fence, raised: false, asked, .. } => {
                acks.push((r.seq, *fence, era(losses, *asked)));
                continue;
            }
            Happened::Granted { token, started, asked, .. } => (*token, *started, *asked, true),
            _ => continue,
        };
        let side = era(losses, asked);
        let before =
            acks.iter().filter(|(seq, _, ack_era)| *seq < asked && *ack_era == side).map(|(_, fence, _)| *fence).max();
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
            if granted.contains(&(token, side)) {
                found.push(Violation {
                    what: format!("lease token {token} granted twice (again at {} ms)", r.at),
                    writes: Vec::new(),
                    tokens: vec![token],
                });
            }
            granted.push((token, side));
        }
        acks.push((r.seq, token, side));
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

    /// Across a loss no replica remembers, an older write asked after it may follow a newer
    /// one asked before it (the stated limit); a write admitted before the loss may not commit
    /// after a newer admission, and two calls both asked after it are judged as ever.
    #[test]
    fn across_an_unremembered_loss_only_the_fence_going_back_is_let_pass() {
        let admitted =
            |t, w, asked| Happened::Admitted { write: w, token: t, replica: 0, started: 0, asked, durable: Some(t) };
        let committed = |t, w| Happened::Committed { write: w, token: t, object: 0 };
        let loss = || Happened::StoreLostState { remembered: false };
        let before = [at(10, admitted(2, 1, 10)), at(20, loss()), at(30, admitted(3, 2, 30)), at(40, committed(2, 1))];
        assert_eq!(check(&before).len(), 1, "the quiet period");
        let back = [at(10, admitted(3, 1, 10)), at(20, loss()), at(30, admitted(2, 2, 30)), at(50, committed(2, 2))];
        assert!(check(&back).is_empty(), "the fence went back: the stated limit");
        let after = [at(20, loss()), at(30, admitted(2, 2, 30)), at(40, admitted(3, 3, 40)), at(50, committed(2, 2))];
        assert_eq!(check(&after).len(), 1, "both after the loss");
        let below = [at(20, loss()), at(30, admitted(3, 3, 30)), at(40, admitted(2, 4, 40))];
        assert_eq!(check(&below).len(), 1, "G1 after the loss");
        let twice = [at(20, loss()), at(30, admitted(3, 3, 30)), at(40, loss()), at(50, admitted(2, 4, 50))];
        assert!(check(&twice).is_empty(), "a second loss lets the fence go back again");
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
