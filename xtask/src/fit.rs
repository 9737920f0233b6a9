//! Growth exponents: least-squares fits of log(y) against log(n).

/// `y ≈ c · n^exponent`, fitted on `ln y = ln c + exponent · ln n`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PowerLaw {
    pub exponent: f64,
    pub coefficient: f64,
}

impl PowerLaw {
    /// The fitted value at `n`.
    pub fn at(&self, n: f64) -> f64 {
        self.coefficient * n.powf(self.exponent)
    }
}

/// The points a fit uses: the upper half of a sweep (where constant costs no longer hide
/// the growth), but at least two points.
pub fn upper_half<T: Copy>(points: &[T]) -> &[T] {
    let start = (points.len() / 2).min(points.len().saturating_sub(2));
    &points[start..]
}

/// Least squares over `(n, y)` with positive coordinates; `None` for fewer than two
/// distinct n.
pub fn power_law(points: &[(f64, f64)]) -> Option<PowerLaw> {
    let logs: Vec<(f64, f64)> = points
        .iter()
        .filter(|(x, y)| *x > 0.0 && *y > 0.0 && y.is_finite())
        .map(|(x, y)| (x.ln(), y.ln()))
        .collect();
    let m = logs.len() as f64;
    let mx = logs.iter().map(|p| p.0).sum::<f64>() / m;
    let my = logs.iter().map(|p| p.1).sum::<f64>() / m;
    let sxx: f64 = logs.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = logs.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    if logs.len() < 2 || sxx <= 0.0 {
        return None;
    }
    let exponent = sxy / sxx;
    Some(PowerLaw {
        exponent,
        coefficient: (my - exponent * mx).exp(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovers_an_exact_power_law() {
        let pts: Vec<(f64, f64)> = [256.0, 512.0, 1024.0f64]
            .iter()
            .map(|&n| (n, 3.0 * n * n))
            .collect();
        let fit = power_law(&pts).unwrap();
        assert!((fit.exponent - 2.0).abs() < 1e-12);
        assert!((fit.at(2048.0) / (3.0 * 2048.0 * 2048.0) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn one_point_has_no_fit() {
        assert_eq!(power_law(&[(4.0, 2.0)]), None);
        assert_eq!(power_law(&[(4.0, 2.0), (4.0, 3.0)]), None);
    }

    #[test]
    fn upper_half_keeps_at_least_two_points() {
        assert_eq!(upper_half(&[1, 2, 3, 4, 5, 6, 7]), &[4, 5, 6, 7]);
        assert_eq!(upper_half(&[1, 2, 3]), &[2, 3]);
        assert_eq!(upper_half(&[1, 2]), &[1, 2]);
        assert_eq!(upper_half(&[1]), &[1]);
    }
}
