//! `simulate --schedules N [--seed S] [--bug NAME] [--threads T] [--history]`: runs the schedules of seeds
//! `S .. S+N`, prints each violation with its seed and a minimal history, and ends with
//! `schedules=N violations=K` (exit 1 when K > 0). With `--bug`, it stops at the first
//! violation, and says after how many schedules it came.

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use super::check::{self, Happened, Record, Violation};
use super::schedule::Schedule;
use super::{Bug, seed_bug, world};

struct Args {
    schedules: u64,
    seed: u64,
    bug: Option<Bug>,
    threads: u64,
    /// Print every schedule's whole history (to read a replayed seed).
    history: bool,
}

fn parse(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut parsed = Args { schedules: 1_000, seed: fresh_seed(), bug: None, threads: 2, history: false };
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
        let number = |name: &str, v: String| v.parse::<u64>().map_err(|_| format!("{name}: not a number: {v:?}"));
        match arg.as_str() {
            "--schedules" => parsed.schedules = number("--schedules", value("--schedules")?)?,
            "--seed" => parsed.seed = number("--seed", value("--seed")?)?,
            "--threads" => parsed.threads = number("--threads", value("--threads")?)?.clamp(1, 64),
            "--bug" => {
                let name = value("--bug")?;
                parsed.bug = Some(Bug::ALL.into_iter().find(|bug| bug.name() == name).ok_or_else(|| {
                    let names: Vec<&str> = Bug::ALL.iter().map(|bug| bug.name()).collect();
                    format!("--bug: no seeded bug {name:?}; there are: {}", names.join(", "))
                })?);
            }
            "--history" => parsed.history = true,
            "-h" | "--help" => return Err(USAGE.to_owned()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    Ok(parsed)
}

const USAGE: &str = "usage: simulate --schedules N [--seed S] [--bug NAME] [--threads T] [--history]";

fn fresh_seed() -> u64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    u64::try_from(nanos % (1 << 48)).unwrap_or(0)
}

/// One schedule's verdict.
fn judge(schedule: &Schedule) -> (Vec<Record>, Vec<Violation>) {
    let run = world::run(schedule);
    let violations = check::check(&run.records);
    (run.records, violations)
}

pub fn main() -> ExitCode {
    let args = match parse(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    println!(
        "simulating {} schedules from seed {} on {} threads{}",
        args.schedules,
        args.seed,
        args.threads,
        args.bug.map(|bug| format!(", with the seeded bug {}", bug.name())).unwrap_or_default()
    );
    let started = Instant::now();
    let next = AtomicU64::new(0);
    let ran = AtomicU64::new(0);
    let found = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let first: std::sync::Mutex<Option<u64>> = std::sync::Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..args.threads {
            scope.spawn(|| {
                seed_bug(args.bug);
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= args.schedules || stop.load(Ordering::SeqCst) {
                        return;
                    }
                    let seed = args.seed.wrapping_add(i);
                    let schedule = Schedule::generate(seed);
                    let (records, violations) = judge(&schedule);
                    ran.fetch_add(1, Ordering::SeqCst);
                    if args.history {
                        let lines: Vec<String> =
                            render(&records).into_iter().map(|line| format!("    {line}\n")).collect();
                        print!("seed={} ({:?}):\n{}", seed, schedule.mode, lines.concat());
                    }
                    if violations.is_empty() {
                        continue;
                    }
                    found.fetch_add(1, Ordering::SeqCst);
                    let mut first = first.lock().expect("first");
                    if first.is_none_or(|f| i < f) {
                        *first = Some(i);
                    }
                    drop(first);
                    report(&schedule);
                    if args.bug.is_some() {
                        stop.store(true, Ordering::SeqCst);
                    }
                }
            });
        }
    });
    let (ran, found) = (ran.load(Ordering::SeqCst), found.load(Ordering::SeqCst));
    let secs = started.elapsed().as_secs_f64();
    println!("{ran} schedules in {secs:.1} s: {:.0} schedules/s", ran as f64 / secs.max(1e-9));
    if let (Some(bug), Some(first)) = (args.bug, *first.lock().expect("first")) {
        println!(
            "the seeded bug {} was found by schedule {} (seed {})",
            bug.name(),
            first + 1,
            args.seed.wrapping_add(first)
        );
    }
    println!("schedules={ran} violations={found}");
    if found > 0 { ExitCode::from(1) } else { ExitCode::SUCCESS }
}

/// A violation's report: the seed, what broke, and the history of the smallest schedule found
/// that still breaks it; and whether the seed replays it exactly.
fn report(schedule: &Schedule) {
    let (records, violations) = judge(schedule);
    let (again, _) = judge(schedule);
    let replays = render(&records) == render(&again);
    let minimal = shrink(schedule);
    let (records, violations_min) = judge(&minimal);
    let shown = violations_min.first().or(violations.first()).cloned();
    let mut out = format!(
        "VIOLATION seed={} ({:?}, {} events; {} in the minimal schedule; the seed replays it exactly: {})\n",
        schedule.seed,
        schedule.mode,
        schedule.events.len(),
        minimal.events.len(),
        if replays { "yes" } else { "NO" }
    );
    for violation in &violations {
        out.push_str(&format!("  {}\n", violation.what));
    }
    if let Some(violation) = violations_min.first() {
        out.push_str(&format!("  in the minimal schedule: {}\n", violation.what));
    }
    out.push_str("  minimal history:\n");
    for record in relevant(&records, shown.as_ref()) {
        out.push_str(&format!("    {record}\n"));
    }
    print!("{out}");
}

fn render(records: &[Record]) -> Vec<String> {
    records.iter().map(ToString::to_string).collect()
}

/// The records a reader needs: faults and starts, and what the violation's writes and tokens
/// did.
fn relevant<'a>(records: &'a [Record], violation: Option<&Violation>) -> Vec<&'a Record> {
    let Some(violation) = violation else { return records.iter().collect() };
    let about = |write: Option<u64>, token: u64| {
        write.is_some_and(|w| violation.writes.contains(&w)) || violation.tokens.contains(&token)
    };
    records
        .iter()
        .filter(|r| match &r.what {
            Happened::Note(_)
            | Happened::Registered { .. }
            | Happened::Granted { .. }
            | Happened::StoreLostState { .. }
            | Happened::End { .. } => true,
            Happened::Admitted { write, token, .. }
            | Happened::Refused { write, token, .. }
            | Happened::HandedOver { write, token }
            | Happened::CutOff { write, token }
            | Happened::Answered { write, token, .. }
            | Happened::Committed { write, token, .. } => about(Some(*write), *token),
        })
        .collect()
}

/// Drops events one at a time while the schedule still breaks a checker (at most a few
/// hundred runs).
fn shrink(schedule: &Schedule) -> Schedule {
    let mut current = schedule.clone();
    let mut runs = 0;
    loop {
        let mut dropped = false;
        let mut i = 0;
        while i < current.events.len() && runs < 400 {
            let mut candidate = current.clone();
            candidate.events.remove(i);
            runs += 1;
            if judge(&candidate).1.is_empty() {
                i += 1;
            } else {
                current = candidate;
                dropped = true;
            }
        }
        if !dropped || runs >= 400 {
            return current;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A seed replays exactly: the same schedule, the same history, record for record.
    #[test]
    fn a_seed_replays_exactly() {
        for seed in [1, 7, 42] {
            let schedule = Schedule::generate(seed);
            assert_eq!(render(&judge(&schedule).0), render(&judge(&schedule).0), "seed {seed}");
        }
    }
}
