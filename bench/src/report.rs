//! The suite's output: a Markdown table (with the issue's targets checked) and an SVG bar
//! chart of throughput, written by hand so the bench needs no plotting library.

use std::fmt::Write as _;

/// One measured line of the table.
#[derive(Debug, Clone)]
pub struct Row {
    pub scenario: String,
    /// `upstream`, `nginx`, `fencegate`, `409 ceiling`.
    pub path: String,
    pub per_second: Option<f64>,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub p999_ms: Option<f64>,
    /// CPU time the server under test (the proxy, or the upstream on the direct path) spent
    /// per request, from `/proc/PID/stat`.
    pub cpu_us_per_request: Option<f64>,
    /// CPU time the load client (the bench's own process, one thread) spent per request.
    pub client_cpu_us_per_request: Option<f64>,
    /// Busy CPU time of the whole machine per request (all processes and the kernel): the
    /// machine's CPUs divided by it bound the rate the row could reach with every CPU busy.
    pub machine_cpu_us_per_request: Option<f64>,
    /// Status counts (`200×1234`), or what else the row measured.
    pub outcome: String,
    /// Whether the chart shows it (throughput rows of the keep-alive load).
    pub charted: bool,
}

impl Row {
    /// A row of what was not a timed load (a stream, a walk of a listing): a rate at most, its
    /// figures in the outcome, no latency or CPU columns, not charted.
    pub fn untimed(scenario: String, path: &str, per_second: Option<f64>, outcome: String) -> Self {
        Self {
            scenario,
            path: path.into(),
            per_second,
            p50_ms: None,
            p99_ms: None,
            p999_ms: None,
            cpu_us_per_request: None,
            client_cpu_us_per_request: None,
            machine_cpu_us_per_request: None,
            outcome,
            charted: false,
        }
    }
}

/// One of the suite's targets, checked.
#[derive(Debug, Clone)]
pub struct Target {
    pub goal: String,
    pub measured: String,
    /// `None`: not measured (the reason is in `measured`).
    pub met: Option<bool>,
}

#[derive(Debug, Default)]
pub struct Suite {
    pub command: String,
    pub setup: Vec<String>,
    pub rows: Vec<Row>,
    pub targets: Vec<Target>,
    pub notes: Vec<String>,
}

fn num(v: Option<f64>, decimals: usize) -> String {
    match v {
        Some(v) => format!("{v:.decimals$}"),
        None => "–".into(),
    }
}

impl Suite {
    pub fn markdown(&self) -> String {
        let mut md = String::new();
        let _ = writeln!(md, "# fencegate benchmark results\n");
        let _ = writeln!(md, "Command: `{}`\n", self.command);
        for line in &self.setup {
            let _ = writeln!(md, "- {line}");
        }
        let _ = writeln!(md, "\n![throughput](chart.svg)\n");
        let _ = writeln!(
            md,
            "| scenario | path | req/s | p50 ms | p99 ms | p99.9 ms | server CPU µs/req | client CPU µs/req | machine CPU µs/req | outcome |"
        );
        let _ = writeln!(md, "|---|---|---:|---:|---:|---:|---:|---:|---:|---|");
        for r in grouped(self.rows.iter().collect()).into_iter().flat_map(|(_, rows)| rows) {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                r.scenario,
                r.path,
                num(r.per_second, 0),
                num(r.p50_ms, 2),
                num(r.p99_ms, 2),
                num(r.p999_ms, 2),
                num(r.cpu_us_per_request, 0),
                num(r.client_cpu_us_per_request, 1),
                num(r.machine_cpu_us_per_request, 1),
                r.outcome
            );
        }
        let _ = writeln!(md, "\n## Targets\n");
        let _ = writeln!(md, "| target | measured | met |");
        let _ = writeln!(md, "|---|---|---|");
        for t in &self.targets {
            let met = match t.met {
                Some(true) => "yes",
                Some(false) => "**no**",
                None => "not measured",
            };
            let _ = writeln!(md, "| {} | {} | {} |", t.goal, t.measured, met);
        }
        if !self.notes.is_empty() {
            let _ = writeln!(md, "\n## Notes\n");
            for n in &self.notes {
                let _ = writeln!(md, "- {n}");
            }
        }
        md
    }

    /// Horizontal bars of req/s, grouped by scenario, each labelled with its p99.
    pub fn svg(&self) -> String {
        const WIDTH: f64 = 960.0;
        const LABEL_X: f64 = 200.0;
        const BAR_X: f64 = 210.0;
        const BAR_W_MAX: f64 = 520.0;
        const BAR_H: f64 = 18.0;
        const GAP: f64 = 5.0;
        const GROUP_GAP: f64 = 16.0;
        let rows: Vec<&Row> = self.rows.iter().filter(|r| r.charted && r.per_second.is_some()).collect();
        let max = rows.iter().filter_map(|r| r.per_second).fold(1.0_f64, f64::max);
        let groups = grouped(rows);
        let mut body = String::new();
        let mut y = 56.0;
        for (name, members) in &groups {
            let _ = writeln!(body, r#"<text x="16" y="{:.0}" class="group">{}</text>"#, y + 12.0, escape(name));
            y += 20.0;
            for r in members {
                let v = r.per_second.unwrap_or(0.0);
                let w = (v / max * BAR_W_MAX).max(1.0);
                let _ = writeln!(
                    body,
                    r#"<text x="{LABEL_X}" y="{:.0}" class="label" text-anchor="end">{}</text>"#,
                    y + 13.0,
                    escape(&r.path)
                );
                let _ = writeln!(
                    body,
                    r#"<rect x="{BAR_X}" y="{y:.0}" width="{w:.1}" height="{BAR_H}" rx="2" fill="{}"/>"#,
                    colour(&r.path)
                );
                let _ = writeln!(
                    body,
                    r#"<text x="{:.1}" y="{:.0}" class="value">{:.0} req/s · p99 {} ms</text>"#,
                    BAR_X + w + 6.0,
                    y + 13.0,
                    v,
                    num(r.p99_ms, 2)
                );
                y += BAR_H + GAP;
            }
            y += GROUP_GAP;
        }
        let height = y + 10.0;
        format!(
            r##"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0}" viewBox="0 0 {WIDTH} {height:.0}" font-family="Helvetica, Arial, sans-serif">
<style>
.title {{ font-size: 17px; font-weight: bold; fill: #222; }}
.sub {{ font-size: 12px; fill: #555; }}
.group {{ font-size: 13px; font-weight: bold; fill: #333; }}
.label {{ font-size: 12px; fill: #333; }}
.value {{ font-size: 12px; fill: #333; }}
</style>
<rect width="100%" height="100%" fill="#ffffff"/>
<text x="16" y="24" class="title">fencegate: requests per second over loopback (longer is better)</text>
<text x="16" y="42" class="sub">same client, same in-memory S3 upstream; SigV4-signed PUTs; p99 latency after each bar</text>
{body}</svg>
"##
        )
    }
}

/// Rows grouped by scenario, groups in order of first appearance (the Redis store's runs
/// come last in a suite but belong beside the embedded store's).
fn grouped(rows: Vec<&Row>) -> Vec<(&str, Vec<&Row>)> {
    let mut groups: Vec<(&str, Vec<&Row>)> = Vec::new();
    for r in rows {
        match groups.iter_mut().find(|(name, _)| *name == r.scenario) {
            Some((_, members)) => members.push(r),
            None => groups.push((&r.scenario, vec![r])),
        }
    }
    groups
}

fn colour(path: &str) -> &'static str {
    match path {
        "upstream" => "#95a5a6",
        "nginx" => "#3498db",
        "bare hyper proxy" => "#2ecc71",
        "signing proxy" => "#1abc9c",
        "fencegate" => "#e67e22",
        "fencegate (redis store)" => "#8e44ad",
        "fencegate (etcd store)" => "#16a085",
        _ => "#27ae60",
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(scenario: &str, path: &str, v: f64) -> Row {
        Row {
            scenario: scenario.into(),
            path: path.into(),
            per_second: Some(v),
            p50_ms: Some(0.5),
            p99_ms: Some(2.0),
            p999_ms: None,
            cpu_us_per_request: Some(40.0),
            client_cpu_us_per_request: Some(6.5),
            machine_cpu_us_per_request: Some(41.0),
            outcome: "200×10".into(),
            charted: true,
        }
    }

    /// The chart has one bar per charted row and the table one line per row.
    #[test]
    fn outputs_show_every_row() {
        let suite = Suite {
            command: "x".into(),
            rows: vec![
                row("accepted", "upstream", 100.0),
                row("accepted", "fencegate", 50.0),
                row("stale", "fencegate", 10.0),
            ],
            ..Suite::default()
        };
        let svg = suite.svg();
        assert_eq!(svg.matches("<rect x=").count(), 3);
        assert!(svg.contains(">accepted</text>") && svg.contains(">stale</text>"));
        let md = suite.markdown();
        assert!(md.contains("| accepted | fencegate | 50 | 0.50 | 2.00 | – | 40 | 6.5 | 41.0 | 200×10 |"));
    }
}
