//! Stored operands and the strided views (every stride sign) over them.

use super::*;

/// How a single-head operand is laid out in memory: every stride sign faer allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum View {
    /// Column-major (faer's own).
    ColMajor,
    /// Row-major (the transpose of a column-major matrix).
    RowMajor,
    /// Negative row stride (`reverse_rows`).
    ReversedRows,
    /// Negative column stride (`reverse_cols`).
    ReversedCols,
    /// Row-major with both strides negative.
    Reversed,
    /// A submatrix of a larger NaN-filled buffer (an engine that reads outside its view
    /// sees NaN).
    Padded,
    /// Zero row stride (`MatRef::from_repeated_row`) when every row is equal; `Padded`
    /// otherwise.
    Broadcast,
}

impl View {
    /// Every view.
    pub const ALL: [View; 7] = [
        View::ColMajor,
        View::RowMajor,
        View::ReversedRows,
        View::ReversedCols,
        View::Reversed,
        View::Padded,
        View::Broadcast,
    ];
}

/// An operand stored in a storage type `T` with the strides of a [`View`].
#[derive(Debug, Clone)]
pub struct StoredMat<T> {
    buf: Mat<T>,
    view: View,
    nrows: usize,
    ncols: usize,
}

pub(super) fn rows_equal(m: MatRef<'_, f32>) -> bool {
    (1..m.nrows()).all(|i| (0..m.ncols()).all(|j| m[(i, j)].to_bits() == m[(0, j)].to_bits()))
}

impl<T: Copy> StoredMat<T> {
    /// Stores the logical matrix `m` (converted with `convert`) so that
    /// [`StoredMat::view`] shows exactly `m` through the strides of `view`.
    ///
    /// ```
    /// use attn_oracle::hostile::{StoredMat, View};
    /// use faer::Mat;
    /// let m = Mat::<f32>::from_fn(3, 2, |i, j| (i * 2 + j) as f32);
    /// for view in View::ALL {
    ///     let s = StoredMat::new(m.as_ref(), view, |x| x);
    ///     assert_eq!(s.view(), m.as_ref());
    /// }
    /// let r = StoredMat::new(m.as_ref(), View::ReversedRows, |x| x);
    /// assert!(r.view().row_stride() < 0);
    /// ```
    pub fn new(m: MatRef<'_, f32>, view: View, convert: impl Fn(f32) -> T) -> Self {
        let (n, d) = (m.nrows(), m.ncols());
        let c = |i: usize, j: usize| convert(m[(i, j)]);
        let view = if view == View::Broadcast && (n == 0 || !rows_equal(m)) {
            View::Padded
        } else {
            view
        };
        let buf = match view {
            View::ColMajor => Mat::from_fn(n, d, c),
            View::RowMajor => Mat::from_fn(d, n, |j, i| c(i, j)),
            View::ReversedRows => Mat::from_fn(n, d, |i, j| c(n - 1 - i, j)),
            View::ReversedCols => Mat::from_fn(n, d, |i, j| c(i, d - 1 - j)),
            View::Reversed => Mat::from_fn(d, n, |j, i| c(n - 1 - i, d - 1 - j)),
            View::Padded => Mat::from_fn(n + 3, d + 2, |i, j| {
                if (1..=n).contains(&i) && (1..=d).contains(&j) {
                    c(i - 1, j - 1)
                } else {
                    convert(f32::NAN)
                }
            }),
            View::Broadcast => Mat::from_fn(1, d, |_, j| c(0, j)),
        };
        Self {
            buf,
            view,
            nrows: n,
            ncols: d,
        }
    }

    /// The view (the logical matrix).
    pub fn view(&self) -> MatRef<'_, T> {
        let b = self.buf.as_ref();
        match self.view {
            View::ColMajor => b,
            View::RowMajor => b.transpose(),
            View::ReversedRows => b.reverse_rows(),
            View::ReversedCols => b.reverse_cols(),
            View::Reversed => b.transpose().reverse_rows_and_cols(),
            View::Padded => b.submatrix(1, 1, self.nrows, self.ncols),
            View::Broadcast => MatRef::from_repeated_row(b.row(0), self.nrows),
        }
    }

    /// The view actually used (`Broadcast` falls back to `Padded` for unequal rows).
    pub fn kind(&self) -> View {
        self.view
    }
}

/// A writable output `[n, d]` in storage type `O`, with the strides of a [`View`]
/// (`Broadcast` is not writable and means `Padded`), pre-filled with NaN so that an entry
/// the engine does not write shows up.
#[derive(Debug, Clone)]
pub struct StoredOut<O> {
    buf: Mat<O>,
    view: View,
    nrows: usize,
    ncols: usize,
}

impl<O: Copy> StoredOut<O> {
    /// An `n × d` output filled with `fill`.
    pub fn new(n: usize, d: usize, view: View, fill: O) -> Self {
        let view = if view == View::Broadcast {
            View::Padded
        } else {
            view
        };
        let buf = match view {
            View::RowMajor | View::Reversed => Mat::from_fn(d, n, |_, _| fill),
            View::Padded => Mat::from_fn(n + 3, d + 2, |_, _| fill),
            _ => Mat::from_fn(n, d, |_, _| fill),
        };
        Self {
            buf,
            view,
            nrows: n,
            ncols: d,
        }
    }

    /// The writable view.
    pub fn view_mut(&mut self) -> MatMut<'_, O> {
        let (n, d) = (self.nrows, self.ncols);
        let b = self.buf.as_mut();
        match self.view {
            View::RowMajor => b.transpose_mut(),
            View::ReversedRows => b.reverse_rows_mut(),
            View::ReversedCols => b.reverse_cols_mut(),
            View::Reversed => b.transpose_mut().reverse_rows_and_cols_mut(),
            View::Padded => b.submatrix_mut(1, 1, n, d),
            View::ColMajor | View::Broadcast => b,
        }
    }

    /// What was written, widened with `widen`.
    pub fn read(&mut self, widen: impl Fn(O) -> f32) -> Mat<f32> {
        let v = self.view_mut();
        Mat::from_fn(v.nrows(), v.ncols(), |i, j| widen(v[(i, j)]))
    }
}

/// A `nrows × row.len()` view whose rows are all `row` (row stride 0): any number of rows,
/// `usize::MAX` included, from one row of memory.
pub fn broadcast_rows<T>(row: &[T], nrows: usize) -> MatRef<'_, T> {
    MatRef::from_repeated_row(RowRef::from_slice(row), nrows)
}
