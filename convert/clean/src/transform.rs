//! Applying a resolved plan to one record batch.
//!
//! Every step is row-wise (a row's fate and its standardized values depend only on that row and
//! on the fixed statistics), so a batch is processed as: one keep-mask per row-removing step,
//! ANDed together, the standardized columns computed for every row, and a single
//! `filter_record_batch` at the end. Filters after the standardize step see standardized
//! values, exactly as in the pandas sequence of statements.
//!
//! Comparisons use IEEE semantics on f64 (NaN and null compare false, except `!=` which is true),
//! like pandas/NumPy; Arrow's own comparison kernels order NaN as the largest value, which would
//! keep NaN rows for `value > 0`, so they are not used here.

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, BooleanArray, Float64Array, RecordBatch};
use arrow::buffer::{BooleanBuffer, NullBuffer};
use arrow::compute::{cast, filter_record_batch};
use arrow::datatypes::{DataType, Field, Float64Type, Schema, SchemaRef};

use super::plan::{Op, Resolved, ResolvedStep};
use super::stats::Accumulator;
use super::CleanError;

/// The output schema: standardized columns become Float64, all columns nullable.
pub fn output_schema(schema: &Schema, plan: &Resolved) -> SchemaRef {
    let fields: Vec<Field> = schema
        .fields()
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let dt = if plan.standardized.contains(&i) {
                DataType::Float64
            } else {
                f.data_type().clone()
            };
            Field::new(f.name(), dt, true)
        })
        .collect();
    Arc::new(Schema::new(fields))
}

/// A numeric column as Float64 (cheap for Float64 itself).
fn as_f64(array: &ArrayRef) -> Result<Float64Array, CleanError> {
    let arr = if array.data_type() == &DataType::Float64 {
        array.clone()
    } else {
        cast(array, &DataType::Float64)?
    };
    Ok(arr.as_primitive::<Float64Type>().clone())
}

/// Rows without a null in any column and without NaN in float columns.
fn notna_mask(columns: &[ArrayRef], len: usize) -> BooleanBuffer {
    let mut mask = BooleanBuffer::new_set(len);
    for col in columns {
        if let Some(nulls) = col.logical_nulls() {
            mask = &mask & nulls.inner();
        }
        match col.data_type() {
            DataType::Float64 => {
                let v = col.as_primitive::<Float64Type>().values();
                let not_nan = BooleanBuffer::collect_bool(len, |i| !v[i].is_nan());
                mask = &mask & &not_nan;
            }
            DataType::Float32 => {
                let v = col.as_primitive::<arrow::datatypes::Float32Type>().values();
                let not_nan = BooleanBuffer::collect_bool(len, |i| !v[i].is_nan());
                mask = &mask & &not_nan;
            }
            _ => {}
        }
    }
    mask
}

/// Rows where `column op value` holds; null counts as NaN.
fn compare_mask(column: &ArrayRef, op: Op, value: f64) -> Result<BooleanBuffer, CleanError> {
    let f = as_f64(column)?;
    let v = f.values();
    let mask = match f.nulls() {
        None => BooleanBuffer::collect_bool(v.len(), |i| op.eval(v[i], value)),
        Some(nulls) => BooleanBuffer::collect_bool(v.len(), |i| {
            op.eval(if nulls.is_valid(i) { v[i] } else { f64::NAN }, value)
        }),
    };
    Ok(mask)
}

/// A standardized copy of a numeric column: `(x - mean) / std`, nulls kept.
fn standardize_column(column: &ArrayRef, mean: f64, std: f64) -> Result<ArrayRef, CleanError> {
    let f = as_f64(column)?;
    let values: Vec<f64> = f.values().iter().map(|x| (x - mean) / std).collect();
    Ok(Arc::new(Float64Array::new(
        values.into(),
        f.nulls().cloned(),
    )))
}

/// Keep-mask of a run of row-removing steps on `columns`.
fn steps_mask(
    steps: &[ResolvedStep],
    columns: &[ArrayRef],
    len: usize,
) -> Result<Option<BooleanBuffer>, CleanError> {
    let mut mask: Option<BooleanBuffer> = None;
    for step in steps {
        let m = match step {
            ResolvedStep::DropNa => notna_mask(columns, len),
            ResolvedStep::Filter { col, op, value } => compare_mask(&columns[*col], *op, *value)?,
            ResolvedStep::Standardize => continue,
        };
        mask = Some(match mask {
            None => m,
            Some(prev) => &prev & &m,
        });
    }
    Ok(mask)
}

/// Pass 1 on one batch: the rows surviving the steps before standardize, and the
/// accumulators of the standardized columns over them. The statistics are taken on the
/// filtered batch (contiguous values, only nulls to skip), which is also what pass 1 keeps
/// for pass 2; the values and their order are those of the masked original, so the bits are.
pub fn accumulate(
    plan: &Resolved,
    batch: &RecordBatch,
) -> Result<(RecordBatch, Vec<Accumulator>), CleanError> {
    let pre = &plan.steps[..plan.standardize_at.unwrap_or(plan.steps.len())];
    let mask = steps_mask(pre, batch.columns(), batch.num_rows())?;
    let kept = apply_mask(batch, mask)?;
    let mut accs = Vec::with_capacity(plan.standardized.len());
    for &c in &plan.standardized {
        let f = as_f64(kept.column(c))?;
        let v = f.values();
        let acc = match f.nulls().filter(|n| n.null_count() > 0) {
            None => Accumulator::from_values(v.iter().copied()),
            Some(n) => Accumulator::from_values(v.iter().zip(n.iter()).map(|(&x, valid)| {
                if valid {
                    x
                } else {
                    f64::NAN
                }
            })),
        };
        accs.push(acc);
    }
    Ok((kept, accs))
}

/// Applies a row mask (all rows when `None`).
pub fn apply_mask(
    batch: &RecordBatch,
    mask: Option<BooleanBuffer>,
) -> Result<RecordBatch, CleanError> {
    match mask {
        Some(m) if m.count_set_bits() != m.len() => {
            Ok(filter_record_batch(batch, &BooleanArray::new(m, None))?)
        }
        _ => Ok(batch.clone()),
    }
}

/// Pass 2 on one batch: every step, in order. `start` skips steps already applied (when the
/// batch comes from pass 1's cache, already reduced by the pre-standardize steps).
/// `moments[k]` is (mean, std) of `plan.standardized[k]`.
pub fn transform(
    plan: &Resolved,
    out_schema: &SchemaRef,
    batch: &RecordBatch,
    start: usize,
    moments: &[(f64, f64)],
) -> Result<RecordBatch, CleanError> {
    let len = batch.num_rows();
    let split = plan.standardize_at.unwrap_or(plan.steps.len());
    let pre = &plan.steps[start.min(split)..split];
    let mut mask = steps_mask(pre, batch.columns(), len)?;
    let mut columns: Vec<ArrayRef> = batch.columns().to_vec();
    if plan.standardize_at.is_some() {
        for (k, &c) in plan.standardized.iter().enumerate() {
            let (mean, std) = moments[k];
            columns[c] = standardize_column(&columns[c], mean, std)?;
        }
        let post = &plan.steps[split + 1..];
        if let Some(m) = steps_mask(post, &columns, len)? {
            mask = Some(match mask {
                None => m,
                Some(prev) => &prev & &m,
            });
        }
    }
    let columns = columns
        .into_iter()
        .zip(out_schema.fields())
        .map(|(c, f)| {
            if c.data_type() == f.data_type() {
                Ok(c)
            } else {
                cast(&c, f.data_type())
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    let out = RecordBatch::try_new(out_schema.clone(), columns)?;
    apply_mask(&out, mask)
}

/// Null buffer helper used by readers: true when a column has any null.
pub fn has_nulls(nulls: Option<&NullBuffer>) -> bool {
    nulls.is_some_and(|n| n.null_count() > 0)
}
