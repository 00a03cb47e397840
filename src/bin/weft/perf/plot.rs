//! `weft perf --plot`: bus bandwidth against message size as a standalone SVG (log-scale x),
//! with baselines (`--baseline FILE`) and physical limits drawn over the run's own curves.

use std::fmt::Write;

/// One curve: busbw (GB/s) at each message size (bytes).
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub label: String,
    pub points: Vec<(u64, f64)>,
    /// Drawn dashed (baselines), so the run's own curves stand out.
    pub dashed: bool,
}

/// A horizontal reference line (a measured limit such as memcpy or iperf3).
#[derive(Debug, Clone, PartialEq)]
pub struct Limit {
    pub label: String,
    pub gbs: f64,
}

const W: f64 = 1000.0;
const H: f64 = 520.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 330.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 60.0;
const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// Renders the plot. Sizes must be positive; series without points are listed but not drawn.
pub fn svg(title: &str, series: &[Series], limits: &[Limit]) -> String {
    let sizes = series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let (mut lo, mut hi) = sizes.fold((u64::MAX, 1u64), |(lo, hi), s| (lo.min(s), hi.max(s)));
    if lo > hi {
        (lo, hi) = (8, 1 << 27);
    }
    let (x0, x1) = ((lo.max(1) as f64).log2().floor(), (hi as f64).log2().ceil());
    let x1 = if x1 <= x0 { x0 + 1.0 } else { x1 };
    let ymax_data = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .chain(limits.iter().map(|l| l.gbs))
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max);
    let ystep = nice_step(ymax_data.max(1e-3) / 5.0);
    let ymax = (ymax_data / ystep).ceil().max(1.0) * ystep;
    let pw = W - LEFT - RIGHT;
    let ph = H - TOP - BOTTOM;
    let px = |size: u64| LEFT + ((size.max(1) as f64).log2() - x0) / (x1 - x0) * pw;
    let py = |v: f64| TOP + ph - (v.clamp(0.0, ymax) / ymax) * ph;

    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    s.push_str(r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = write!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
        LEFT + pw / 2.0,
        escape(title)
    );
    // Grid and axes.
    let mut e = x0 as i64;
    while e as f64 <= x1 {
        let x = LEFT + (e as f64 - x0) / (x1 - x0) * pw;
        let _ = write!(
            s,
            r##"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}" stroke="#e5e5e5"/>"##,
            TOP + ph
        );
        if (e - x0 as i64) % 2 == 0 || x1 - x0 <= 12.0 {
            let _ = write!(
                s,
                r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                TOP + ph + 18.0,
                size_label(1u64 << e.clamp(0, 62))
            );
        }
        e += 1;
    }
    let mut v = 0.0;
    while v <= ymax + ystep / 2.0 {
        let y = py(v);
        let _ = write!(
            s,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e5e5e5"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT + pw,
            LEFT - 6.0,
            y + 4.0,
            trim_float(v)
        );
        v += ystep;
    }
    let _ = write!(
        s,
        r##"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>"##
    );
    let _ = write!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">message size (bytes, log scale)</text>"#,
        LEFT + pw / 2.0,
        H - 15.0
    );
    let _ = write!(
        s,
        r#"<text x="18" y="{:.1}" text-anchor="middle" transform="rotate(-90 18 {:.1})">busbw (GB/s)</text>"#,
        TOP + ph / 2.0,
        TOP + ph / 2.0
    );
    // Limits, then curves, then the legend.
    let mut legend_y = TOP + 10.0;
    for l in limits.iter().filter(|l| l.gbs.is_finite() && l.gbs > 0.0) {
        let y = py(l.gbs);
        let _ = write!(
            s,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#777" stroke-dasharray="2,4"/>"##,
            LEFT + pw
        );
        let _ = write!(
            s,
            r##"<text x="{:.1}" y="{:.1}" fill="#555">{}</text>"##,
            LEFT + pw + 8.0,
            legend_y + 4.0,
            escape(&format!("··· {} {:.2} GB/s", l.label, l.gbs))
        );
        legend_y += 18.0;
    }
    for (i, ser) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let dash = if ser.dashed {
            r#" stroke-dasharray="7,4""#
        } else {
            ""
        };
        let pts: Vec<String> = ser
            .points
            .iter()
            .filter(|p| p.0 > 0 && p.1.is_finite())
            .map(|&(size, bw)| format!("{:.1},{:.1}", px(size), py(bw)))
            .collect();
        if !pts.is_empty() {
            let _ = write!(
                s,
                r#"<polyline fill="none" stroke="{color}" stroke-width="2"{dash} points="{}"/>"#,
                pts.join(" ")
            );
            for p in &pts {
                let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
                let _ = write!(s, r#"<circle cx="{x}" cy="{y}" r="2.5" fill="{color}"/>"#);
            }
        }
        let _ = write!(
            s,
            r#"<line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{color}" stroke-width="2"{dash}/><text x="{:.1}" y="{:.1}">{}</text>"#,
            LEFT + pw + 8.0,
            legend_y,
            LEFT + pw + 30.0,
            legend_y,
            LEFT + pw + 36.0,
            legend_y + 4.0,
            escape(&shorten(&ser.label, 44))
        );
        legend_y += 18.0;
    }
    s.push_str("</svg>\n");
    s
}

/// `text` cut to `max` characters (with an ellipsis), so legends fit the margin.
fn shorten(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_string();
    }
    let mut s: String = text.chars().take(max - 1).collect();
    s.push('…');
    s
}

/// 1, 2 or 5 times a power of ten, at least `raw`.
fn nice_step(raw: f64) -> f64 {
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * p)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * p)
}

fn trim_float(v: f64) -> String {
    let t = format!("{v:.3}");
    t.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// 8, 512, 1K, 64K, 1M, 2G.
pub fn size_label(bytes: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1 << 30, "G"), (1 << 20, "M"), (1 << 10, "K")];
    for (unit, suffix) in UNITS {
        if bytes >= unit && bytes.is_multiple_of(unit) {
            return format!("{}{suffix}", bytes / unit);
        }
    }
    bytes.to_string()
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(label: &str, pts: &[(u64, f64)], dashed: bool) -> Series {
        Series {
            label: label.into(),
            points: pts.to_vec(),
            dashed,
        }
    }

    #[test]
    fn draws_every_point_and_legend_entry() {
        let a = series(
            "weft out-of-place",
            &[(8, 0.01), (1 << 20, 6.0), (1 << 27, 7.5)],
            false,
        );
        let b = series("OpenMPI <4.1>", &[(8, 0.02), (1 << 27, 1.6)], true);
        let lim = Limit {
            label: "memcpy".into(),
            gbs: 11.4,
        };
        let out = svg("all-reduce, 2 ranks", &[a, b], &[lim]);
        assert!(out.starts_with("<svg") && out.trim_end().ends_with("</svg>"));
        assert_eq!(out.matches("<circle").count(), 5);
        assert_eq!(out.matches("<polyline").count(), 2);
        assert!(out.contains("OpenMPI &lt;4.1&gt;"), "labels are escaped");
        assert!(out.contains("stroke-dasharray=\"7,4\""), "baselines dashed");
        assert!(out.contains("memcpy 11.40 GB/s"));
        assert!(out.contains(">2M<") && out.contains(">128M<"));
        // The y axis reaches the largest value (the limit line) and no point is off the plot.
        assert!(out.contains(">15<"), "{out}");
    }

    #[test]
    fn higher_bandwidth_is_drawn_higher_and_larger_sizes_further_right() {
        let out = svg(
            "t",
            &[series("s", &[(1024, 1.0), (1 << 20, 4.0)], false)],
            &[],
        );
        let circles: Vec<(f64, f64)> = out
            .split("<circle cx=\"")
            .skip(1)
            .map(|c| {
                let x: f64 = c.split('"').next().unwrap().parse().unwrap();
                let y: f64 = c
                    .split("cy=\"")
                    .nth(1)
                    .unwrap()
                    .split('"')
                    .next()
                    .unwrap()
                    .parse()
                    .unwrap();
                (x, y)
            })
            .collect();
        assert_eq!(circles.len(), 2);
        assert!(circles[1].0 > circles[0].0);
        assert!(circles[1].1 < circles[0].1, "SVG y grows downwards");
    }

    #[test]
    fn empty_and_degenerate_inputs_still_render() {
        for out in [
            svg("empty", &[], &[]),
            svg("one", &[series("s", &[(8, 0.0)], false)], &[]),
            svg(
                "nan",
                &[series("s", &[(8, f64::NAN), (16, 1.0)], false)],
                &[],
            ),
        ] {
            assert!(out.contains("</svg>"));
            assert!(!out.contains("NaN"));
        }
    }

    #[test]
    fn labels() {
        assert_eq!(size_label(8), "8");
        assert_eq!(size_label(1024), "1K");
        assert_eq!(size_label(128 << 20), "128M");
        assert_eq!(size_label(3 << 30), "3G");
        assert_eq!(size_label(1536), "1536");
        assert_eq!(nice_step(0.7), 1.0);
        assert_eq!(nice_step(1.3), 2.0);
        assert_eq!(nice_step(3.0), 5.0);
    }
}
