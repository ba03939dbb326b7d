//! HTTP plumbing both fronts stand on, with nothing of fencing in it: the listeners' accept
//! loops and connection limits ([`server`]), the serving threads ([`threads`]), the one
//! outbound HTTP client ([`outbound`]), a served request's body ([`request_body`]), a forwarded
//! write's body ([`body`]), problem documents ([`problem`]) and percent-decoding ([`percent`]).

pub mod body;
pub mod outbound;
pub mod percent;
pub mod problem;
pub mod request_body;
pub mod server;
pub mod threads;
