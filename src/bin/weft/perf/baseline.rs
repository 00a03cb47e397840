//! Baselines for `weft perf --baseline FILE`, and the converter (`weft baseline-json`) that turns
//! the text of `benches/baseline.sh` (or any nccl-tests-style table, weft perf's own
//! included) into that JSON.
//!
//! The JSON: `{"label": "...", "limits": [{"label": "memcpy", "gbs": 11.4}, ...],
//! "rows": [{"size": 8, "count": 2, "time_us": 0.5, "algbw": 0.01, "busbw": 0.01, "wrong": 0}]}`.
//! `--baseline` also reads the array `weft perf --json` writes (its out-of-place columns).

use super::plot::{Limit, Series};
use serde::{Deserialize, Serialize};

/// One measured size of a baseline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BaselineRow {
    pub size: u64,
    pub count: u64,
    pub time_us: f64,
    pub algbw: f64,
    pub busbw: f64,
    pub wrong: Option<u64>,
}

/// A baseline file: a curve and the limits measured beside it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Baseline {
    pub label: String,
    #[serde(default)]
    pub limits: Vec<LimitJson>,
    pub rows: Vec<BaselineRow>,
}

/// A measured limit (memcpy, a+=b, iperf3) in GB/s.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LimitJson {
    pub label: String,
    pub gbs: f64,
}

/// The out-of-place half of a `weft perf --json` row, as `--baseline` reads it.
#[derive(Deserialize)]
struct PerfJsonRow {
    collective: String,
    size: u64,
    count: u64,
    nranks: usize,
    oop: PerfJsonHalf,
}

#[derive(Deserialize)]
struct PerfJsonHalf {
    time_us: f64,
    algbw: f64,
    busbw: f64,
    wrong: Option<u64>,
}

/// Parses baseline text: `baseline.sh` output (memory and iperf3 limits, then the MPI table) or
/// nccl-tests-style tables. Lines that are not table rows or known limit lines are skipped.
pub fn parse_text(text: &str, label: Option<&str>) -> Result<Baseline, String> {
    let mut limits = Vec::new();
    let mut rows = Vec::new();
    let mut title: Option<String> = None;
    for line in text.lines() {
        let t = line.trim();
        if let Some(rest) = t.strip_prefix("== ") {
            if rest.contains("MPI") || rest.contains("weft") || rest.contains("nccl") {
                title = Some(rest.trim().to_string());
            }
            continue;
        }
        if t.starts_with("memcpy") {
            // "memcpy 256 MiB: 11.36 GB/s copied; reduce a+=b: 5.79 GB/s of a"
            for (name, part) in [("memcpy", 0usize), ("a+=b", 1)] {
                if let Some(v) = t.split(';').nth(part).and_then(gbs_before_unit) {
                    limits.push(LimitJson {
                        label: name.into(),
                        gbs: v,
                    });
                }
            }
            continue;
        }
        if t.ends_with("receiver") {
            if let Some(v) = gbs_before_unit(t) {
                limits.push(LimitJson {
                    label: "iperf3 loopback".into(),
                    gbs: v,
                });
            }
            continue;
        }
        if t.starts_with('#') || t.is_empty() {
            continue;
        }
        if let Some(row) = table_row(t) {
            rows.push(row);
        }
    }
    if rows.is_empty() {
        return Err("no table rows found (expected baseline.sh or nccl-tests output)".into());
    }
    Ok(Baseline {
        label: label
            .map(str::to_string)
            .or(title)
            .unwrap_or_else(|| "baseline".into()),
        limits,
        rows,
    })
}

/// The number before "GB/s" or "GBytes/sec" in `text`.
fn gbs_before_unit(text: &str) -> Option<f64> {
    let words: Vec<&str> = text.split_whitespace().collect();
    let at = words
        .iter()
        .position(|w| w.starts_with("GB/s") || w.starts_with("GBytes/sec"))?;
    words.get(at.checked_sub(1)?)?.parse().ok()
}

/// A 6-column baseline row (size count time algbw busbw #wrong) or an nccl-tests row (size count
/// type redop root time algbw busbw #wrong ...; the out-of-place half).
fn table_row(line: &str) -> Option<BaselineRow> {
    let w: Vec<&str> = line.split_whitespace().collect();
    let num = |i: usize| w.get(i).and_then(|s| s.parse::<f64>().ok());
    let int = |i: usize| w.get(i).and_then(|s| s.parse::<u64>().ok());
    let (size, count) = (int(0)?, int(1)?);
    // The time, algbw, busbw and #wrong columns from `at` on.
    let row_from = |at: usize| {
        Some(BaselineRow {
            size,
            count,
            time_us: num(at)?,
            algbw: num(at + 1)?,
            busbw: num(at + 2)?,
            wrong: int(at + 3),
        })
    };
    if w.len() == 6 {
        return row_from(2);
    }
    if w.len() >= 9 && w[2].parse::<f64>().is_err() {
        return row_from(5);
    }
    None
}

/// Reads a `--baseline` file: the converter's JSON, or a `weft perf --json` array.
pub fn read(path: &std::path::Path) -> Result<Baseline, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read baseline {}: {e}", path.display()))?;
    from_json(&text, &path.display().to_string())
}

fn from_json(text: &str, name: &str) -> Result<Baseline, String> {
    if let Ok(b) = serde_json::from_str::<Baseline>(text) {
        return Ok(b);
    }
    match serde_json::from_str::<Vec<PerfJsonRow>>(text) {
        Ok(rows) if !rows.is_empty() => Ok(Baseline {
            label: format!(
                "{} {} ranks ({name})",
                rows[0].collective, rows[0].nranks
            ),
            limits: Vec::new(),
            rows: rows
                .into_iter()
                .map(|r| BaselineRow {
                    size: r.size,
                    count: r.count,
                    time_us: r.oop.time_us,
                    algbw: r.oop.algbw,
                    busbw: r.oop.busbw,
                    wrong: r.oop.wrong,
                })
                .collect(),
        }),
        Ok(_) => Err(format!("baseline {name} has no rows")),
        Err(e) => Err(format!(
            "baseline {name} is neither `weft baseline-json` output nor `weft perf --json` output: {e}"
        )),
    }
}

impl Baseline {
    /// The curve and limit lines to draw.
    pub fn plot_parts(&self) -> (Series, Vec<Limit>) {
        (
            Series {
                label: self.label.clone(),
                points: self.rows.iter().map(|r| (r.size, r.busbw)).collect(),
                dashed: true,
            },
            self.limits
                .iter()
                .map(|l| Limit {
                    label: l.label.clone(),
                    gbs: l.gbs,
                })
                .collect(),
        )
    }
}

/// Arguments of `weft baseline-json`.
#[derive(clap::Args, Debug, Clone)]
pub struct BaselineArgs {
    /// Text to convert (`baseline.sh` or nccl-tests output); `-` or absent reads standard input.
    pub input: Option<std::path::PathBuf>,
    /// Curve label (default: the table's `== ...` title).
    #[arg(long)]
    pub label: Option<String>,
    /// Write here instead of standard output.
    #[arg(short = 'o', long = "output")]
    pub output: Option<std::path::PathBuf>,
}

/// Entry point of `weft baseline-json`.
pub fn main(args: BaselineArgs) -> i32 {
    let text = match args.input.as_deref() {
        Some(p) if p.as_os_str() != "-" => {
            std::fs::read_to_string(p).map_err(|e| format!("cannot read {}: {e}", p.display()))
        }
        _ => std::io::read_to_string(std::io::stdin()).map_err(|e| format!("stdin: {e}")),
    };
    let result = text
        .and_then(|t| parse_text(&t, args.label.as_deref()))
        .and_then(|b| {
            let json = serde_json::to_string_pretty(&b).map_err(|e| e.to_string())? + "\n";
            match &args.output {
                Some(p) => std::fs::write(p, json)
                    .map_err(|e| format!("cannot write {}: {e}", p.display())),
                None => {
                    print!("{json}");
                    Ok(())
                }
            }
        });
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("weft baseline-json: {e}");
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASELINE_SH: &str = "\
== memory limit
memcpy 256 MiB: 11.36 GB/s copied; reduce a+=b: 5.79 GB/s of a
== TCP loopback limit (iperf3, 1 stream, 3 s)
[  5]   0.00-3.00   sec  15.3 GBytes  5.09 GBytes/sec                  receiver
== OpenMPI MPI_Allreduce, 2 ranks (shared memory)
        size        count   time(us)      algbw      busbw  #wrong
           8            2        0.6      0.013      0.013       0
     1048576       262144      310.7      3.375      3.375       0
   134217728     33554432    79000.0      1.699      1.699       0
";

    #[test]
    fn converts_the_baseline_script_output() {
        let b = parse_text(BASELINE_SH, None).unwrap();
        assert_eq!(b.label, "OpenMPI MPI_Allreduce, 2 ranks (shared memory)");
        assert_eq!(
            b.limits,
            vec![
                LimitJson {
                    label: "memcpy".into(),
                    gbs: 11.36
                },
                LimitJson {
                    label: "a+=b".into(),
                    gbs: 5.79
                },
                LimitJson {
                    label: "iperf3 loopback".into(),
                    gbs: 5.09
                },
            ]
        );
        assert_eq!(b.rows.len(), 3);
        assert_eq!(
            b.rows[1],
            BaselineRow {
                size: 1 << 20,
                count: 262144,
                time_us: 310.7,
                algbw: 3.375,
                busbw: 3.375,
                wrong: Some(0)
            }
        );
        // The JSON round-trips through what --baseline reads.
        let json = serde_json::to_string(&b).unwrap();
        assert_eq!(from_json(&json, "x").unwrap(), b);
    }

    #[test]
    fn converts_nccl_tests_rows_and_takes_the_out_of_place_half() {
        let text = "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong\n\
                    \x20    1048576        262144     float     sum      -1    150.0    6.99    6.99      0    140.0    7.49    7.49      0\n";
        let b = parse_text(text, Some("weft")).unwrap();
        assert_eq!(b.label, "weft");
        assert_eq!(b.rows[0].time_us, 150.0);
        assert_eq!(b.rows[0].busbw, 6.99);
    }

    #[test]
    fn reads_weft_perf_json_arrays() {
        let json = r#"[{"collective":"all_reduce","size":8,"count":2,"type":"float","redop":"sum","root":-1,"nranks":2,
            "oop":{"time_us":0.7,"algbw":0.01,"busbw":0.01,"wrong":0},"ip":{"time_us":0.7,"algbw":0.01,"busbw":0.01,"wrong":0}}]"#;
        let b = from_json(json, "run.json").unwrap();
        assert_eq!(b.label, "all_reduce 2 ranks (run.json)");
        assert_eq!(b.rows[0].time_us, 0.7);
    }

    #[test]
    fn rejects_what_is_not_a_baseline() {
        assert!(parse_text("hello\nworld\n", None).is_err());
        assert!(from_json("{\"a\": 1}", "x").is_err());
        assert!(from_json("[]", "x").is_err());
        assert!(from_json("not json", "x").is_err());
    }
}
