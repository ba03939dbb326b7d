//! The one place where a presented token is judged against a fence. Pure: no I/O, no clock.

use super::FenceToken;

/// What to do with a write that presents a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Older than the fence: reject, and tell the caller the current fence.
    Stale { current: FenceToken },
    /// Equal to the fence: admit. Writes with the current token run concurrently.
    Current,
    /// Newer than the fence (or the first token ever seen): the fence must advance, durably,
    /// before the write is admitted.
    Advance,
}

/// Judges `presented` against `fence` (`None`: no token was ever seen for the resource).
pub fn decide(fence: Option<FenceToken>, presented: FenceToken) -> Decision {
    match fence {
        None => Decision::Advance,
        Some(f) if presented < f => Decision::Stale { current: f },
        Some(f) if presented == f => Decision::Current,
        Some(_) => Decision::Advance,
    }
}

/// The fence that makes `presented` stale, if one does: [`decide`]'s `Stale`, for the callers
/// that only refuse (a read of the fence before a body, a stamp found on the object, a lapsed
/// lease's last write, the uploads of superseded tokens).
pub fn stale_below(fence: Option<FenceToken>, presented: FenceToken) -> Option<FenceToken> {
    match decide(fence, presented) {
        Decision::Stale { current } => Some(current),
        Decision::Current | Decision::Advance => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every pair from a set that covers both ends of the range and the neighbours of each
    /// value: the decision is exactly the ordering of the two numbers.
    #[test]
    fn decision_is_exactly_the_order_of_the_tokens() {
        let edges = [0, 1, 2, 11, 12, 13, u64::MAX / 2, u64::MAX - 1, u64::MAX];
        for &p in &edges {
            assert_eq!(decide(None, FenceToken(p)), Decision::Advance);
            for &f in &edges {
                let got = decide(Some(FenceToken(f)), FenceToken(p));
                let want = match p.cmp(&f) {
                    std::cmp::Ordering::Less => Decision::Stale { current: FenceToken(f) },
                    std::cmp::Ordering::Equal => Decision::Current,
                    std::cmp::Ordering::Greater => Decision::Advance,
                };
                assert_eq!(got, want, "fence {f}, presented {p}");
            }
        }
    }
}
