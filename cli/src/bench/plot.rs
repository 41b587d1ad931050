//! `--plot FILE.svg`: bandwidth and message rate against message size per transport, and
//! each transport's latency percentiles.

use std::collections::BTreeMap;
use std::path::Path;

use plotters::prelude::*;

use super::proto::Pattern;
use super::report::{Row, size_label};

/// The quantiles of the latency plot, as "nines": x = 1 / (1 - q).
const QUANTILES: [f64; 9] = [0.5, 0.75, 0.9, 0.95, 0.99, 0.995, 0.999, 0.9999, 0.99999];

type Series = BTreeMap<String, Vec<(f64, f64)>>;

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Writes the SVG. Points that are missing (no streaming points, no latency points) leave
/// their panel with a note instead.
pub(crate) fn write_svg(path: &Path, rows: &[Row], title: &str) -> Result<(), String> {
    let root = SVGBackend::new(path, (1500, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled(title, ("sans-serif", 18)).map_err(err)?;
    let panels = root.split_evenly((1, 3));

    let mut bw = Series::new();
    let mut rate = Series::new();
    for r in rows.iter().filter(|r| r.pattern != Pattern::Lat) {
        let x = r.size.max(1) as f64;
        let name = format!("{} {}", r.transport, r.pattern.as_str());
        bw.entry(name.clone())
            .or_default()
            .push((x, r.outcome.gbytes_per_s));
        rate.entry(name)
            .or_default()
            .push((x, r.outcome.msgs_per_s));
    }
    for s in bw.values_mut().chain(rate.values_mut()) {
        s.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    by_size(
        &panels[0],
        "Bandwidth at the receiver",
        "GB/s",
        &bw,
        SeriesLabelPosition::UpperLeft,
    )?;
    by_size(
        &panels[1],
        "Message rate at the receiver",
        "messages/s",
        &rate,
        SeriesLabelPosition::UpperRight,
    )?;

    // Latency: per transport, its smallest lat point.
    let mut lat = Series::new();
    let mut chosen: BTreeMap<String, usize> = BTreeMap::new();
    for r in rows.iter().filter(|r| r.pattern == Pattern::Lat) {
        let Some(h) = r.outcome.latency.as_ref() else {
            continue;
        };
        if chosen.get(&r.transport).is_some_and(|&s| s <= r.size) {
            continue;
        }
        chosen.insert(r.transport.clone(), r.size);
        let n = h.len() as f64;
        let points = QUANTILES
            .iter()
            // A percentile needs samples beyond it to mean anything.
            .filter(|&&q| n * (1.0 - q) >= 1.0)
            .map(|&q| (1.0 / (1.0 - q), h.value_at_quantile(q) as f64 / 1e3))
            .collect();
        lat.insert(format!("{} {}", r.transport, size_label(r.size)), points);
    }
    percentiles(&panels[2], &lat)?;
    root.present().map_err(err)
}

fn empty(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    what: &str,
) -> Result<(), String> {
    area.draw(&Text::new(
        format!("no {what} points in this run"),
        (60, 200),
        ("sans-serif", 16),
    ))
    .map_err(err)
}

/// Bounds of the y values, padded for a log axis.
fn y_range(series: &Series) -> (f64, f64) {
    let ys = series.values().flatten().map(|p| p.1).filter(|y| *y > 0.0);
    let (lo, hi) = ys.fold((f64::MAX, f64::MIN), |(lo, hi), y| (lo.min(y), hi.max(y)));
    if lo > hi {
        (0.1, 10.0)
    } else {
        (lo / 2.0, hi * 2.0)
    }
}

/// A tick label with about three significant digits and an SI prefix: 0.25, 12.5, 3.2 M.
fn short(y: f64) -> String {
    let (v, unit) = match y.abs() {
        a if a >= 1e9 => (y / 1e9, " G"),
        a if a >= 1e6 => (y / 1e6, " M"),
        a if a >= 1e4 => (y / 1e3, " k"),
        _ => (y, ""),
    };
    let digits = match v.abs() {
        a if a >= 100.0 => 0,
        a if a >= 10.0 => 1,
        a if a >= 1.0 => 2,
        _ => 3,
    };
    format!("{v:.digits$}{unit}")
}

fn by_size(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    caption: &str,
    unit: &str,
    series: &Series,
    legend: SeriesLabelPosition,
) -> Result<(), String> {
    let xs = series.values().flatten().map(|p| p.0);
    let (x_lo, x_hi) = xs.fold((f64::MAX, f64::MIN), |(lo, hi), x| (lo.min(x), hi.max(x)));
    if x_lo > x_hi {
        return empty(area, "streaming");
    }
    let (y_lo, y_hi) = y_range(series);
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(
            (x_lo / 2.0..x_hi * 2.0).log_scale().base(2.0),
            (y_lo..y_hi).log_scale(),
        )
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("message size")
        .y_desc(unit)
        .x_label_formatter(&|x| size_label(x.round() as usize))
        .y_label_formatter(&|y| short(*y))
        .draw()
        .map_err(err)?;
    draw_series(&mut chart, series, legend)
}

fn percentiles(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    series: &Series,
) -> Result<(), String> {
    if series.values().all(Vec::is_empty) {
        return empty(area, "latency");
    }
    let (y_lo, y_hi) = y_range(series);
    let x_hi = series.values().flatten().map(|p| p.0).fold(10.0, f64::max);
    let mut chart = ChartBuilder::on(area)
        .caption(
            "Latency (half round trip) by percentile",
            ("sans-serif", 16),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d((1.5..x_hi * 1.5).log_scale(), (y_lo..y_hi).log_scale())
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("percentile")
        .y_desc("µs")
        .x_label_formatter(&|x| {
            let p = format!("{:.4}", 100.0 * (1.0 - 1.0 / x));
            format!("{}%", p.trim_end_matches('0').trim_end_matches('.'))
        })
        .y_label_formatter(&|y| short(*y))
        .draw()
        .map_err(err)?;
    draw_series(&mut chart, series, SeriesLabelPosition::UpperLeft)
}

fn draw_series<'a, X, Y>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, Y>>,
    series: &Series,
    legend: SeriesLabelPosition,
) -> Result<(), String>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    for (i, (name, points)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(err)?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color.stroke_width(2)));
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(legend)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)
}
