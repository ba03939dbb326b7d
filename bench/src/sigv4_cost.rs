//! What the two signatures of a forwarded write cost natively: the incoming SigV4 check
//! (`Verifier::verify`, its signing key cached) and the signature made anew for the upstream
//! (`Signer::sign`, its day key cached), on the head `fencegate-bench` sends for an accepted
//! 1 KiB PUT (`UNSIGNED-PAYLOAD`: the body is not hashed). These are the floor under any
//! fenced write, set against the bare proxy's whole CPU per request in docs/benchmarks.md, and
//! the verification is part of the stale path's target (`suite`).
//!
//!     target/release/fencegate-bench sigv4-cost [--iterations N]
//!
//! Prints the median over 7 rounds of N calls each (default 200,000), in ns per call.

use std::collections::HashMap;
use std::hint::black_box;
use std::time::{Instant, SystemTime};

use fencegate::aws::sigv4::{Signer, Verifier};
use http::{HeaderValue, Method, Request};

const ACCESS_KEY: &str = "fencegate-dev";
const SECRET: &str = "fencegate-dev-secret";
const ROUNDS: usize = 7;

/// The medians, ns per call.
#[derive(Debug, Clone, Copy)]
pub struct Costs {
    pub verify_ns: f64,
    pub sign_ns: f64,
    pub clone_ns: f64,
}

/// Times both signatures, `iterations` calls a round.
pub fn measure(iterations: u32) -> Costs {
    let now = SystemTime::now();

    // The client's head, signed as an SDK signs it (fencegate's own signer signs every header).
    let client = Signer::new(ACCESS_KEY.into(), SECRET.into(), "us-east-1".into());
    let incoming = head("/bench/obj-17", "127.0.0.1:9000");
    let mut signed = incoming.clone();
    client.sign(&mut signed, now).expect("the client's head signs");
    let verifier = Verifier::new(HashMap::from([(ACCESS_KEY.to_owned(), SECRET.to_owned())]));
    let (method, uri, headers) = (signed.method().as_str().to_owned(), signed.uri().clone(), signed.headers().clone());
    assert!(verifier.verify(&method, &uri, &headers, now).is_some(), "the signed head verifies");

    let verify_ns = median_ns(iterations, || {
        black_box(verifier.verify(black_box(&method), black_box(&uri), black_box(&headers), now));
    });

    // The upstream's head: the client's without its signature, signed with fencegate's key.
    let upstream = Signer::new("upstream-key".into(), "upstream-secret".into(), "us-east-1".into());
    let forwarded = head("/bench/obj-17", "127.0.0.1:9001");
    let sign = median_ns(iterations, || {
        let mut req = forwarded.clone();
        upstream.sign(&mut req, now).expect("the upstream head signs");
        black_box(req);
    });
    let clone_ns = median_ns(iterations, || {
        black_box(forwarded.clone());
    });
    Costs { verify_ns, sign_ns: sign - clone_ns, clone_ns }
}

/// `fencegate-bench sigv4-cost`.
pub fn print(iterations: u32) {
    let costs = measure(iterations);
    println!("iterations per round: {iterations}, rounds: {ROUNDS}, median ns per call");
    println!("verify the client's SigV4 signature (key cached): {:.0} ns", costs.verify_ns);
    println!("sign the upstream request anew (day key cached):  {:.0} ns", costs.sign_ns);
    println!("  (the head's clone, taken out of the line above: {:.0} ns)", costs.clone_ns);
}

/// The head of an accepted 1 KiB PUT as `fencegate-bench load` sends it.
fn head(path: &str, authority: &str) -> Request<()> {
    let mut req = Request::builder().method(Method::PUT).uri(path).body(()).expect("a valid head");
    let h = req.headers_mut();
    h.insert(http::header::HOST, HeaderValue::from_str(authority).expect("an authority"));
    h.insert(http::header::CONTENT_LENGTH, HeaderValue::from(1024));
    h.insert("fencing-token", HeaderValue::from(2));
    h.insert("fencing-resource", HeaderValue::from_static("job-17"));
    req
}

/// The median over [`ROUNDS`] rounds of the time per call of `f`, in ns.
fn median_ns(iterations: u32, mut f: impl FnMut()) -> f64 {
    for _ in 0..iterations / 10 {
        f();
    }
    let mut rounds: Vec<f64> = (0..ROUNDS)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..iterations {
                f();
            }
            start.elapsed().as_nanos() as f64 / f64::from(iterations)
        })
        .collect();
    rounds.sort_by(f64::total_cmp);
    rounds[ROUNDS / 2]
}
