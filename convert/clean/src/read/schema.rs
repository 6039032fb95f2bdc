//! Column names and types: inferred for a CSV, renamed where they repeat, unified across files.
//!
//! A CSV's types come from its first [`INFER_RECORDS`] records: each column remembers whether
//! it saw booleans, integers, floats or text, and takes pandas' choice (any text → string,
//! ints with floats → float64, nothing → float64). Dates stay text, as pandas leaves them.
//! Repeated or empty names are renamed exactly as pandas' `read_csv` does ([`dedup_names`]).
//! Across files, names must match in order; types widen as pandas' `concat` would
//! ([`unify_schemas`]).

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;
use std::sync::Arc;

use arrow::datatypes::{DataType, Field, Schema, SchemaRef};

use super::Input;
use crate::CleanError;

/// Records read per CSV file to infer its column types (pandas reads all; Arrow needs a bound).
/// 20 000 rows is a few MB, read once per file, and catches the usual late floats in an
/// integer-looking column.
pub const INFER_RECORDS: usize = 20_000;

/// Pandas does not parse dates by default; keep them as text. A column that is empty in the
/// sample is float (all NaN), as pandas reads it.
pub(super) fn pandas_csv_type(dt: &DataType) -> DataType {
    match dt {
        DataType::Null => DataType::Float64,
        DataType::Date32
        | DataType::Date64
        | DataType::Time32(_)
        | DataType::Time64(_)
        | DataType::Timestamp(_, _) => DataType::Utf8,
        other => other.clone(),
    }
}

/// Column names as pandas' `read_csv` gives them: an empty name becomes `Unnamed: <i>`, and
/// a repeated name `a` becomes `a.1`, `a.2`, ..., skipping any name present in the header
/// (`a,a,a.1` → `a, a.2, a.1`; named columns are renamed before unnamed ones), exactly as
/// pandas' `mangle_dupe_names` does. Parquet output cannot hold two columns of one name
/// (pyarrow refuses such a file), so duplicates are renamed rather than refused: the output
/// has the columns pandas would show.
pub fn dedup_names(names: &mut [String]) {
    // Hash lookups, not list scans: a header of 10^6 repeated names was quadratic (minutes).
    let is_unnamed: Vec<bool> = names.iter().map(|n| n.is_empty()).collect();
    for (i, n) in names.iter_mut().enumerate() {
        if n.is_empty() {
            *n = format!("Unnamed: {i}");
        }
    }
    // How many entries of `names` hold each name right now.
    let mut present: HashMap<String, usize> = HashMap::new();
    for n in names.iter() {
        *present.entry(n.clone()).or_default() += 1;
    }
    let order: Vec<usize> = (0..names.len())
        .filter(|&i| !is_unnamed[i])
        .chain((0..names.len()).filter(|&i| is_unnamed[i]))
        .collect();
    let mut counts: HashMap<String, usize> = HashMap::new();
    for i in order {
        let old = names[i].clone();
        let mut col = old.clone();
        let mut cur = counts.get(&col).copied().unwrap_or(0);
        while cur > 0 {
            counts.insert(old.clone(), cur + 1);
            col = format!("{old}.{cur}");
            if present.get(&col).is_some_and(|&n| n > 0) {
                cur += 1;
            } else {
                cur = counts.get(&col).copied().unwrap_or(0);
            }
        }
        counts.insert(col.clone(), cur + 1);
        if col != old {
            if let Some(n) = present.get_mut(&old) {
                *n -= 1;
            }
            *present.entry(col.clone()).or_default() += 1;
        }
        names[i] = col;
    }
}

/// A schema whose duplicate column names are renamed as [`dedup_names`] does.
pub(super) fn dedup_schema(schema: &SchemaRef) -> SchemaRef {
    let mut names: Vec<String> = schema.fields().iter().map(|f| f.name().clone()).collect();
    dedup_names(&mut names);
    if names
        .iter()
        .zip(schema.fields())
        .all(|(n, f)| n == f.name())
    {
        return schema.clone();
    }
    let fields: Vec<Field> = schema
        .fields()
        .iter()
        .zip(names)
        .map(|(f, n)| f.as_ref().clone().with_name(n))
        .collect();
    Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()))
}

/// What the values of one CSV column looked like so far.
#[derive(Clone, Copy, Default)]
struct Seen {
    bool: bool,
    int: bool,
    float: bool,
    text: bool,
}

impl Seen {
    fn update(&mut self, v: &[u8]) {
        let v = v.trim_ascii();
        if v.is_empty() {
            return;
        }
        if v.eq_ignore_ascii_case(b"true") || v.eq_ignore_ascii_case(b"false") {
            self.bool = true;
            return;
        }
        let Ok(s) = std::str::from_utf8(v) else {
            self.text = true;
            return;
        };
        if s.parse::<i64>().is_ok() {
            self.int = true;
        } else if s.parse::<f64>().is_ok() {
            self.float = true;
        } else {
            self.text = true;
        }
    }

    /// pandas' choice: any text → string; bools alone → bool; ints alone → int64; any
    /// float → float64; nothing seen → float64 (an all-NaN column).
    fn data_type(self) -> DataType {
        match self {
            Seen { text: true, .. } => DataType::Utf8,
            Seen {
                bool: true,
                int: false,
                float: false,
                ..
            } => DataType::Boolean,
            Seen { bool: true, .. } => DataType::Utf8,
            Seen {
                int: true,
                float: false,
                ..
            } => DataType::Int64,
            _ => DataType::Float64,
        }
    }
}

/// Header and column types from the first [`INFER_RECORDS`] records. Records with the wrong
/// number of fields are ignored here (they are reported, with their line, when decoded).
pub(super) fn infer_csv(path: &Path, reader: impl Read) -> Result<Schema, CleanError> {
    let mut rdr = csv::ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .from_reader(reader);
    let bad = |e: csv::Error| {
        CleanError::Data(format!(
            "{}: cannot read the CSV header: {e}",
            path.display()
        ))
    };
    let mut record = csv::ByteRecord::new();
    if !rdr.read_byte_record(&mut record).map_err(bad)? {
        return Err(CleanError::Data(format!(
            "{}: empty file (a CSV needs a header line)",
            path.display()
        )));
    }
    // Names as pandas gives them: untrimmed, a UTF-8 byte-order mark dropped.
    let mut names: Vec<String> = record
        .iter()
        .map(|n| String::from_utf8_lossy(n).to_string())
        .collect();
    if let Some(first) = names.first_mut() {
        if let Some(rest) = first.strip_prefix('\u{feff}') {
            *first = rest.to_string();
        }
    }
    dedup_names(&mut names);
    let mut seen = vec![Seen::default(); names.len()];
    let mut n = 0;
    while n < INFER_RECORDS && rdr.read_byte_record(&mut record).map_err(bad)? {
        n += 1;
        if record.len() != names.len() {
            continue;
        }
        for (s, v) in seen.iter_mut().zip(record.iter()) {
            s.update(v);
        }
    }
    Ok(Schema::new(
        names
            .into_iter()
            .zip(seen)
            .map(|(n, s)| Field::new(n, s.data_type(), true))
            .collect::<Vec<_>>(),
    ))
}

/// The common type of one column across files, as pandas' concat would give it.
fn unify_type(a: &DataType, b: &DataType) -> Option<DataType> {
    if a == b {
        return Some(a.clone());
    }
    if a.is_integer() && b.is_integer() {
        return Some(DataType::Int64);
    }
    if (a.is_integer() || a.is_floating()) && (b.is_integer() || b.is_floating()) {
        return Some(DataType::Float64);
    }
    let text =
        |t: &DataType| matches!(t, DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View);
    if text(a) && text(b) {
        return Some(DataType::Utf8);
    }
    None
}

/// One schema for all inputs: same column names in the same order; types unified.
pub fn unify_schemas(inputs: &[Input]) -> Result<SchemaRef, CleanError> {
    let first = &inputs[0];
    let names =
        |s: &Schema| -> Vec<String> { s.fields().iter().map(|f| f.name().clone()).collect() };
    let mut types: Vec<DataType> = first
        .schema
        .fields()
        .iter()
        .map(|f| f.data_type().clone())
        .collect();
    for other in &inputs[1..] {
        if names(&other.schema) != names(&first.schema) {
            return Err(CleanError::Data(format!(
                "{} has columns [{}] but {} has [{}]; all inputs must have the same columns \
                 in the same order",
                other.path.display(),
                names(&other.schema).join(", "),
                first.path.display(),
                names(&first.schema).join(", ")
            )));
        }
        for (i, f) in other.schema.fields().iter().enumerate() {
            types[i] = unify_type(&types[i], f.data_type()).ok_or_else(|| {
                CleanError::Data(format!(
                    "column '{}' is {} in {} but {} in {}",
                    f.name(),
                    types[i],
                    first.path.display(),
                    f.data_type(),
                    other.path.display()
                ))
            })?;
        }
    }
    let fields: Vec<Field> = first
        .schema
        .fields()
        .iter()
        .zip(types)
        .map(|(f, t)| Field::new(f.name(), t, true))
        .collect();
    Ok(Arc::new(Schema::new(fields)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicate_names_are_mangled_as_pandas_read_csv_does() {
        // Expected lists are pandas 3.1's read_csv column names for these headers.
        let cases: [(&[&str], &[&str]); 5] = [
            (&["a", "a", "b"], &["a", "a.1", "b"]),
            (&["a", "a.1", "a"], &["a", "a.1", "a.2"]),
            (&["a", "a", "a.1"], &["a", "a.2", "a.1"]),
            (&["a", "a", "a", "a.1"], &["a", "a.2", "a.3", "a.1"]),
            (&["", "x", ""], &["Unnamed: 0", "x", "Unnamed: 2"]),
        ];
        for (input, want) in cases {
            let mut names: Vec<String> = input.iter().map(|s| s.to_string()).collect();
            dedup_names(&mut names);
            assert_eq!(names, want, "{input:?}");
        }
    }
}
