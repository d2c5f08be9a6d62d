//! PNG plot of the loss and accuracy curves.

use super::MetricsLog;
use crate::{Error, Result};
use plotters::prelude::*;
use std::path::Path;

fn err(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::format("plot", path, e.to_string())
}

/// Draws loss (left) and accuracy (right) per epoch, train and test, into a PNG.
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
        (&left, "loss", |m| m.train_loss, |m| m.test_loss),
        (
            &right,
            "accuracy (%)",
            |m| 100.0 * m.train_acc,
            |m| 100.0 * m.test_acc,
        ),
    ];
    for (area, name, train, test) in panels {
        let (tr, te) = (series(train), series(test));
        let ys = tr.iter().chain(&te).map(|p| p.1).filter(|v| v.is_finite());
        let (lo, hi) = ys.fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(v), b.max(v)));
        let pad = ((hi - lo) * 0.1).max(1e-3);
        let mut chart = ChartBuilder::on(area)
            .caption(name, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(x_lo..x_hi, (lo - pad)..(hi + pad))
            .map_err(|e| err(path, e))?;
        chart
            .configure_mesh()
            .x_desc("epoch")
            .draw()
            .map_err(|e| err(path, e))?;
        for (pts, color, label) in [(tr, BLUE, "train"), (te, RED, "test")] {
            chart
                .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                .map_err(|e| err(path, e))?
                .label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
            chart
                .draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
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
