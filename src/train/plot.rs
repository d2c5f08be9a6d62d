//! PNG plot of the loss and accuracy curves.

use super::MetricsLog;
use crate::{Error, Result};
use plotters::prelude::*;
use std::path::Path;

fn err(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::format("plot", path, e.to_string())
}

/// Largest magnitude drawn: beyond it a value is drawn at the edge, so the axis range and its
/// tick marks stay finite.
const BIG: f64 = 1e100;

/// The y range of `values`' finite ones (at most [`BIG`] in size; `(0, 1)` when none is
/// finite), widened to a span of at least 1e-3, and whether any was finite.
fn y_range(values: impl Iterator<Item = f64>) -> (f64, f64, bool) {
    let finite = values.filter(|v| v.is_finite()).map(|v| v.clamp(-BIG, BIG));
    let (lo, hi) = finite.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
        (a.min(v), b.max(v))
    });
    if lo > hi {
        return (0.0, 1.0, false);
    }
    let mid = 0.5 * (lo + hi);
    let half = (0.5 * (hi - lo)).max(5e-4);
    (mid - half, mid + half, true)
}

/// `p` with its value clamped into the drawn range.
fn clamped(p: (f64, f64), lo: f64, hi: f64) -> (f64, f64) {
    (p.0, p.1.clamp(lo, hi))
}

/// Draws loss (left) and accuracy (right) per epoch, train and test, into a PNG. Non-finite
/// values (a loss that became NaN or infinite) leave a gap in their line and are marked with
/// a cross at the top of the panel; a panel without any finite value says so.
pub fn plot_metrics(log: &MetricsLog, path: &Path) -> Result<()> {
    static FONT: std::sync::Once = std::sync::Once::new();
    FONT.call_once(|| {
        let _ = plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            dejavu::sans::regular(),
        );
    });
    if log.epochs.is_empty() {
        return Err(err(path, "no epochs to plot"));
    }
    let root = BitMapBackend::new(path, (1000, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(path, e))?;
    let (left, right) = root.split_horizontally(500);
    let first = log.epochs[0].epoch as f64;
    let last = log.epochs.last().map_or(first, |m| m.epoch as f64);
    let (x_lo, x_hi) = if last > first {
        (first, last)
    } else {
        (first - 0.5, first + 0.5)
    };
    let series = |f: fn(&super::EpochMetrics) -> f64| -> Vec<(f64, f64)> {
        log.epochs.iter().map(|m| (m.epoch as f64, f(m))).collect()
    };
    type Pick = fn(&super::EpochMetrics) -> f64;
    let panels: [(&_, &str, Pick, Pick); 2] = [
        (
            &left,
            log.loss_unit.axis(),
            |m| m.train_loss,
            |m| m.test_loss,
        ),
        (
            &right,
            "accuracy (%)",
            |m| 100.0 * m.train_acc,
            |m| 100.0 * m.test_acc,
        ),
    ];
    for (area, name, train, test) in panels {
        let (tr, te) = (series(train), series(test));
        let (lo, hi, any) = y_range(tr.iter().chain(&te).map(|p| p.1));
        let pad = (hi - lo) * 0.1;
        let (y_lo, y_hi) = (lo - pad, hi + pad);
        let caption = match any {
            true => name.to_string(),
            false => format!("{name} (no finite values)"),
        };
        let mut chart = ChartBuilder::on(area)
            .caption(caption, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(x_lo..x_hi, y_lo..y_hi)
            .map_err(|e| err(path, e))?;
        chart
            .configure_mesh()
            .x_desc("epoch")
            .draw()
            .map_err(|e| err(path, e))?;
        // Near the top edge: where a non-finite value is marked.
        let top = hi + 0.5 * pad;
        for (pts, color, label) in [(tr, BLUE, "train"), (te, RED, "test")] {
            // Finite runs as lines, with a gap at each non-finite value.
            let runs = pts.split(|p| !p.1.is_finite()).filter(|r| !r.is_empty());
            for run in runs {
                chart
                    .draw_series(LineSeries::new(
                        run.iter().map(|&p| clamped(p, lo, hi)),
                        color.stroke_width(2),
                    ))
                    .map_err(|e| err(path, e))?;
            }
            chart
                .draw_series(
                    pts.iter()
                        .filter(|p| p.1.is_finite())
                        .map(|&p| Circle::new(clamped(p, lo, hi), 3, color.filled())),
                )
                .map_err(|e| err(path, e))?
                .label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
            chart
                .draw_series(
                    pts.iter()
                        .filter(|p| !p.1.is_finite())
                        .map(|p| Cross::new((p.0, top), 5, color.stroke_width(2))),
                )
                .map_err(|e| err(path, e))?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(path, e))?;
    }
    root.present().map_err(|e| err(path, e))
}
