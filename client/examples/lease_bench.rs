//! Measures the lease service of one running fencegate, in bounded loops: acquire latency
//! (sequential, a fresh name each time, so every call is a grant), renew latency (one lease,
//! sequential), release latency, and grants per second with concurrent clients.
//!
//!   cargo run -p fencegate-client --example lease_bench -- http://127.0.0.1:9000 [iterations] [concurrency]

use std::time::{Duration, Instant};

use fencegate_client::{Credentials, LeaseClient};

/// Long enough to outlive the run; every lease is released at the end anyway.
const TTL: Duration = Duration::from_secs(120);

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let endpoint = args.next().unwrap_or_else(|| "http://127.0.0.1:9000".into());
    let iterations: usize = args.next().map_or(Ok(2000), |a| a.parse())?;
    let concurrency: usize = args.next().map_or(Ok(16), |a| a.parse())?;
    let credentials = Credentials::new("fencegate-dev", "fencegate-dev-secret", None, None, "bench");
    let client = LeaseClient::new(&endpoint, credentials, "us-east-1")?;
    let run = std::process::id();

    // Warm the connection pool and the store.
    let warm = client.try_acquire(&format!("bench:{run}:warm"), "bench", TTL).await?;
    client.release(&warm.name, &warm.lease_id).await?;

    let mut acquire = Vec::with_capacity(iterations);
    let mut release = Vec::with_capacity(iterations);
    for i in 0..iterations {
        let name = format!("bench:{run}:acquire:{i}");
        let started = Instant::now();
        let grant = client.try_acquire(&name, "bench", TTL).await?;
        acquire.push(started.elapsed());
        let started = Instant::now();
        client.release(&name, &grant.lease_id).await?;
        release.push(started.elapsed());
    }

    let held = client.try_acquire(&format!("bench:{run}:renew"), "bench", TTL).await?;
    let mut renew = Vec::with_capacity(iterations);
    for _ in 0..iterations {
        let started = Instant::now();
        client.renew(&held.name, &held.lease_id).await?;
        renew.push(started.elapsed());
    }
    client.release(&held.name, &held.lease_id).await?;

    // Grants per second: `concurrency` clients, each granting fresh names, `iterations` in all.
    let per_task = iterations.div_ceil(concurrency);
    let started = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|t| {
            let client = client.clone();
            tokio::spawn(async move {
                let mut grants = Vec::with_capacity(per_task);
                for i in 0..per_task {
                    let name = format!("bench:{run}:grants:{t}:{i}");
                    grants.push(client.try_acquire(&name, "bench", TTL).await?);
                }
                Ok::<_, fencegate_client::LeaseError>(grants)
            })
        })
        .collect();
    let mut grants = Vec::with_capacity(iterations);
    for task in tasks {
        grants.extend(task.await??);
    }
    let elapsed = started.elapsed();
    let granted = grants.len();
    for g in grants {
        client.release(&g.name, &g.lease_id).await?;
    }

    println!("endpoint={endpoint} iterations={iterations} concurrency={concurrency}");
    report("acquire", &mut acquire);
    report("renew", &mut renew);
    report("release", &mut release);
    println!(
        "grants_per_second={:.0} ({granted} grants in {:.2} s)",
        granted as f64 / elapsed.as_secs_f64(),
        elapsed.as_secs_f64()
    );
    Ok(())
}

fn report(what: &str, samples: &mut [Duration]) {
    samples.sort_unstable();
    let at = |q: usize| samples[(samples.len() * q / 100).min(samples.len() - 1)];
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "{what}: n={} p50={:.3} ms p99={:.3} ms max={:.3} ms",
        samples.len(),
        ms(at(50)),
        ms(at(99)),
        ms(samples[samples.len() - 1])
    );
}
