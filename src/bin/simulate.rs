//! `scripts/simulate`: runs seeded schedules of fencegate's own code on simulated time
//! (`fencegate::sim`), and exits 1 when a checker found a violation.

fn main() -> std::process::ExitCode {
    fencegate::sim::main()
}
