//! SVG plots of the report (plotters' SVG backend draws text as SVG text elements, so no
//! system font is needed).

use std::path::Path;

use attn_benches::catalog::{Dtype, Engine, Pass, Workload};
use attn_benches::protocol::Status;
use plotters::prelude::*;

use crate::fit::PowerLaw;
use crate::report::{Fit, MIB, Record, Report, RunSettings};

type PlotResult = Result<(), Box<dyn std::error::Error>>;

/// The plot files written next to the report, with their titles: time, memory and rate
/// of the forward pass, then the same three of the backward pass when it was swept.
pub fn plots(settings: &RunSettings) -> Vec<(&'static str, &'static str)> {
    let rate = match settings.workload {
        Workload::SelfAttention => ("gflops.svg", "GFLOP/s against n, with the GEMM roof"),
        Workload::Decode => (
            "bandwidth.svg",
            "GB/s of K and V read against n_k, with the bandwidth roof",
        ),
    };
    let mut files = vec![
        (
            "time.svg",
            "median time against n (log-log), with the fitted power laws",
        ),
        (
            "memory.svg",
            "peak memory growth against n (log-log), with the fitted power laws",
        ),
        rate,
    ];
    if settings.backward {
        files.extend([
            (
                "backward-time.svg",
                "backward pass: median time against n (log-log), with the fitted power laws",
            ),
            (
                "backward-memory.svg",
                "backward pass: peak memory growth against n (log-log), with the fitted power \
                 laws",
            ),
            (
                "backward-gflops.svg",
                "backward pass: GFLOP/s (2.5 × the forward's FLOPs) against n, with the GEMM \
                 roof",
            ),
        ]);
    }
    files
}

/// One engine-and-dtype curve of one pass.
struct Series {
    label: String,
    color: RGBColor,
    /// Backward curves are drawn with triangles, forward ones with circles.
    pass: Pass,
    points: Vec<(f64, f64)>,
    fit: Option<(PowerLaw, f64, f64)>,
}

fn color(engine: Engine, pass: Pass, dtype: Dtype) -> RGBColor {
    let base = match (engine, pass) {
        (Engine::Reference, Pass::Forward) => RGBColor(31, 119, 180),
        (Engine::Baseline, Pass::Forward) => RGBColor(214, 39, 40),
        (Engine::Optimized, Pass::Forward) => RGBColor(44, 160, 44),
        // Other hues for the backward pass, so that its curves never read as a forward's.
        (Engine::Reference, Pass::Backward) => RGBColor(148, 103, 189),
        (Engine::Baseline, Pass::Backward) => RGBColor(140, 86, 75),
        (Engine::Optimized, Pass::Backward) => RGBColor(255, 127, 14),
    };
    match dtype {
        Dtype::F32 => base,
        // Lighter shades for the half-precision variants of the same engine.
        Dtype::F16 => RGBColor(base.0 / 2 + 100, base.1 / 2 + 100, base.2 / 2 + 100),
        Dtype::Bf16 => RGBColor(base.0 / 3 + 60, base.1 / 3 + 60, base.2 / 3 + 60),
    }
}

/// The label of a curve: "optimized f32", "optimized f32 backward".
fn label(engine: Engine, pass: Pass, dtype: Dtype) -> String {
    match pass {
        Pass::Forward => format!("{engine} {dtype}"),
        Pass::Backward => format!("{engine} {dtype} backward"),
    }
}

fn series(
    report: &Report,
    pass: Pass,
    y: impl Fn(&Record) -> Option<f64>,
    law: impl Fn(&Fit) -> Option<PowerLaw>,
    scale: f64,
) -> Vec<Series> {
    let mut out: Vec<Series> = Vec::new();
    for r in report.records.iter().filter(|r| r.pass == pass) {
        if r.status != Status::Ok {
            continue;
        }
        let Some(v) = y(r).filter(|v| *v > 0.0 && v.is_finite()) else {
            continue;
        };
        let label = label(r.engine, r.pass, r.dtype);
        match out.iter_mut().find(|s| s.label == label) {
            Some(s) => s.points.push((r.n_k as f64, v)),
            None => out.push(Series {
                fit: report
                    .fits
                    .iter()
                    .find(|f| (f.engine, f.pass, f.dtype) == (r.engine, r.pass, r.dtype))
                    .and_then(|f| {
                        let l = law(f)?;
                        let lo = *f.n_used.first()? as f64;
                        let hi = *f.n_used.last()? as f64;
                        Some((
                            PowerLaw {
                                exponent: l.exponent,
                                coefficient: l.coefficient / scale,
                            },
                            lo,
                            hi,
                        ))
                    }),
                label,
                color: color(r.engine, r.pass, r.dtype),
                pass: r.pass,
                points: vec![(r.n_k as f64, v)],
            }),
        }
    }
    out
}

fn bounds(series: &[Series], extra: &[f64]) -> Option<((f64, f64), (f64, f64))> {
    let pts = series.iter().flat_map(|s| s.points.iter().copied());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::INFINITY, 0.0f64, f64::INFINITY, 0.0f64);
    for (x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    for &y in extra {
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    (x1 > 0.0).then_some(((x0 / 1.3, x1 * 1.3), (y0, y1)))
}

/// A tick label with about three significant digits.
fn short(y: &f64) -> String {
    let a = y.abs();
    if a >= 100.0 || a == 0.0 {
        format!("{y:.0}")
    } else if a >= 10.0 {
        format!("{y:.1}")
    } else if a >= 1.0 {
        format!("{y:.2}")
    } else {
        format!("{y:.3}")
    }
}

fn seconds_label(y: &f64) -> String {
    crate::report::seconds(*y)
}

/// The labels and scale of one plot.
struct Axes<'a> {
    title: &'a str,
    /// The shape and settings of the run, under the title.
    subtitle: &'a str,
    x_desc: &'a str,
    y_desc: &'a str,
    y_fmt: &'a dyn Fn(&f64) -> String,
    log_y: bool,
}

fn draw(
    path: &Path,
    axes: &Axes<'_>,
    series: &[Series],
    roof: Option<(f64, String)>,
) -> PlotResult {
    let Axes {
        title,
        subtitle,
        x_desc,
        y_desc,
        y_fmt,
        log_y,
    } = *axes;
    let root = SVGBackend::new(path, (900, 580)).into_drawing_area();
    root.fill(&WHITE)?;
    let extra: Vec<f64> = roof.iter().map(|r| r.0).collect();
    let Some(((x0, x1), (y0, y1))) = bounds(series, &extra) else {
        root.titled(&format!("{title}: no successful case"), ("sans-serif", 20))?;
        root.present()?;
        return Ok(());
    };
    // The run's settings as a footer, so a plot read on its own says what it measured.
    let (root, footer) = root.split_vertically(580 - 26);
    footer.draw(&Text::new(
        subtitle.to_string(),
        (16, 4),
        ("sans-serif", 13).into_font().color(&BLACK.mix(0.7)),
    ))?;
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(76);
    let x_fmt = |x: &f64| format!("{x:.0}");
    if log_y {
        // Reach out to the neighbouring powers of ten: a log axis labels only those, and a
        // range inside one decade would carry no label at all.
        let lo = (y0 / 1.5).min(10f64.powf(y0.log10().floor()));
        let hi = (y1 * 1.5).max(10f64.powf(y1.log10().ceil()));
        // Room above the data for the legend (upper left, about 15 px per entry of the
        // ~450 px plot: one per curve and one for the fits), so that it never hides the
        // curves of the slow engines, which run along the top.
        let entries = series.len() + usize::from(series.iter().any(|s| s.fit.is_some()));
        let legend = ((entries * 15 + 20) as f64 / 450.0).min(0.5);
        let hi = lo * (hi / lo).powf(1.0 / (1.0 - legend));
        let mut chart =
            builder.build_cartesian_2d((x0..x1).log_scale().base(2.0), (lo..hi).log_scale())?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc(y_desc)
            .x_label_formatter(&x_fmt)
            .y_label_formatter(y_fmt)
            .draw()?;
        for s in series {
            let c = s.color;
            // The curve's fitted exponent goes in its own legend entry; the dashed fit
            // lines share one.
            let label = match s.fit {
                Some((law, _, _)) => format!("{}: n^{:.2}", s.label, law.exponent),
                None => s.label.clone(),
            };
            chart
                .draw_series(LineSeries::new(s.points.iter().copied(), c.stroke_width(2)))?
                .label(label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                });
            match s.pass {
                Pass::Forward => {
                    chart.draw_series(s.points.iter().map(|&p| Circle::new(p, 4, c.filled())))?
                }
                Pass::Backward => chart.draw_series(
                    s.points
                        .iter()
                        .map(|&p| TriangleMarker::new(p, 6, c.filled())),
                )?,
            };
            if let Some((law, lo, hi)) = s.fit {
                let steps = 16;
                let line = (0..=steps).map(|i| {
                    let n = lo * (hi / lo).powf(i as f64 / steps as f64);
                    (n, law.at(n))
                });
                chart.draw_series(DashedLineSeries::new(
                    line,
                    8,
                    5,
                    BLACK.mix(0.6).stroke_width(1),
                ))?;
            }
        }
        if series.iter().any(|s| s.fit.is_some()) {
            // One legend entry for every dashed fit line, after the curves'.
            chart
                .draw_series(std::iter::empty::<PathElement<(f64, f64)>>())?
                .label("dashed: least-squares power law over the upper half of the sweep")
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.mix(0.6)));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
    } else {
        let mut chart =
            // Headroom above the data and the roof for the legend.
            builder.build_cartesian_2d((x0..x1).log_scale().base(2.0), 0.0..y1 * 1.6)?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc(y_desc)
            .x_label_formatter(&x_fmt)
            .y_label_formatter(y_fmt)
            .draw()?;
        if let Some((r, label)) = roof {
            chart
                .draw_series(LineSeries::new([(x0, r), (x1, r)], BLACK.stroke_width(2)))?
                .label(label)
                .legend(|(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], BLACK.stroke_width(2))
                });
        }
        for s in series {
            let c = s.color;
            chart
                .draw_series(LineSeries::new(s.points.iter().copied(), c.stroke_width(2)))?
                .label(s.label.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                });
            match s.pass {
                Pass::Forward => {
                    chart.draw_series(s.points.iter().map(|&p| Circle::new(p, 4, c.filled())))?
                }
                Pass::Backward => chart.draw_series(
                    s.points
                        .iter()
                        .map(|&p| TriangleMarker::new(p, 6, c.filled())),
                )?,
            };
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

/// Writes [`plots`] into `dir`.
pub fn write_all(report: &Report, dir: &Path) -> PlotResult {
    let files = plots(&report.settings);
    let x_desc = match report.settings.workload {
        Workload::SelfAttention => "n (sequence length, n_q = n_k)",
        Workload::Decode => "n_k (cached keys; one query per head)",
    };
    let st = &report.settings;
    let subtitle = format!(
        "{} heads, d = {}, {} threads, {}, mask {}; {} (load average {} → {})",
        st.heads,
        st.d,
        st.threads,
        match st.workload {
            Workload::SelfAttention => "n_q = n_k",
            Workload::Decode => "n_q = 1",
        },
        if st.causal {
            "causal (top-left)"
        } else {
            "none"
        },
        report.machine.cpu,
        report.load_average[0].map_or("?".into(), |l| format!("{l:.2}")),
        report.load_average[1].map_or("?".into(), |l| format!("{l:.2}")),
    );
    let gemm_roof = report
        .roofs
        .gemm
        .median
        .map(|r| (r, format!("f32 GEMM roof {r:.0} GFLOP/s")));
    // Time, memory and rate of each pass, three files each, in the order of `plots`.
    let passes: &[Pass] = if st.backward {
        &[Pass::Forward, Pass::Backward]
    } else {
        &[Pass::Forward]
    };
    for (&pass, files) in passes.iter().zip(files.chunks_exact(3)) {
        let titles = match pass {
            Pass::Forward => [
                "Time against n",
                "Peak memory growth over the inputs against n",
                match st.workload {
                    Workload::SelfAttention => "Throughput against n",
                    Workload::Decode => "Decoding: K and V read per second",
                },
            ],
            Pass::Backward => [
                "Backward pass: time against n",
                "Backward pass: peak memory growth over the inputs against n",
                "Backward pass: throughput against n (2.5 × the forward's FLOPs)",
            ],
        };
        let time = series(report, pass, |r| r.median_s, |f| f.time(), 1.0);
        let axes = Axes {
            title: titles[0],
            subtitle: &subtitle,
            x_desc,
            y_desc: "median time",
            y_fmt: &seconds_label,
            log_y: true,
        };
        draw(&dir.join(files[0].0), &axes, &time, None)?;
        let memory = series(report, pass, |r| r.peak_mib, |f| f.memory(), MIB);
        let axes = Axes {
            title: titles[1],
            y_desc: "MiB",
            y_fmt: &short,
            ..axes
        };
        draw(&dir.join(files[1].0), &axes, &memory, None)?;
        let axes = Axes {
            title: titles[2],
            log_y: false,
            ..axes
        };
        let (rate, roof, axes) = match st.workload {
            Workload::SelfAttention => (
                series(report, pass, |r| r.gflops, |_| None, 1.0),
                gemm_roof.clone(),
                Axes {
                    y_desc: "GFLOP/s",
                    ..axes
                },
            ),
            Workload::Decode => (
                series(report, pass, |r| r.gbs, |_| None, 1.0),
                report
                    .roofs
                    .bandwidth
                    .median
                    .map(|r| (r, format!("read bandwidth roof {r:.1} GB/s"))),
                Axes {
                    y_desc: "GB/s",
                    ..axes
                },
            ),
        };
        draw(&dir.join(files[2].0), &axes, &rate, roof)?;
    }
    Ok(())
}
