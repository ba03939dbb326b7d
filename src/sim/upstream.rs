//! The simulated upstream: it commits a request it received whole at most `D` after receiving
//! it (the one timing assumption, at its edge when the schedule says so), and answers as the
//! schedule's plan says: before or after committing, with a success, a failed precondition, a
//! server error, a 202, a broken connection.

use std::sync::Arc;

use super::check::Happened;
use super::schedule::{Answer, Plan};
use super::world::Log;
use crate::fence::outcome::Delivery;

/// A call that failed: `delivered` when the request may have reached the upstream whole.
#[derive(Debug)]
pub struct Failed {
    pub delivered: bool,
}

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.delivered { f.write_str("connection broken after sending") } else { f.write_str("not sent") }
    }
}

impl Delivery for Failed {
    fn maybe_delivered(&self) -> bool {
        self.delivered
    }
}

/// Receives `write` whole now: its commit (if any) is scheduled on the upstream's own time,
/// whatever becomes of the replica that sent it; the answer comes back after the plan's delay.
pub async fn receive(
    log: Arc<Log>,
    write: u64,
    token: u64,
    object: u8,
    plan: Plan,
) -> Result<http::Response<()>, Failed> {
    if let Some(commit_ms) = plan.commit_ms {
        let log = log.clone();
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(commit_ms)).await;
            log.record(Happened::Committed { write, token, object });
        });
    }
    tokio::time::sleep(std::time::Duration::from_millis(plan.answer_ms)).await;
    let status = match plan.answer {
        Answer::Ok => 200,
        Answer::PreconditionFailed => 412,
        Answer::ServerError => 503,
        Answer::Accepted => 202,
        Answer::Reset | Answer::Refused => return Err(Failed { delivered: true }),
    };
    Ok(http::Response::builder().status(status).body(()).expect("a status is a response"))
}
