//! The cleaning plan: the steps in command-line order, checked against the input schema before
//! any data is read.
//!
//! A plan is a list of [`Step`]s. Statistics for `standardize` are taken over the rows that
//! survive the steps *before* it (pandas semantics: `df = df.dropna(); df = df[df.value > 0];
//! df[c] = (df[c] - df[c].mean()) / df[c].std()`), so the steps are split at the standardize
//! step: pass 1 runs the prefix and accumulates statistics, pass 2 runs everything.

use std::fmt;

use arrow::datatypes::{DataType, Schema};

use super::CleanError;

/// A comparison operator of a `--filter`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// `>`
    Gt,
    /// `>=`
    Ge,
    /// `<`
    Lt,
    /// `<=`
    Le,
    /// `==`
    Eq,
    /// `!=`
    Ne,
}

impl Op {
    /// The operator's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Gt => ">",
            Op::Ge => ">=",
            Op::Lt => "<",
            Op::Le => "<=",
            Op::Eq => "==",
            Op::Ne => "!=",
        }
    }

    /// IEEE comparison, so NaN compares false except for `!=` (as in pandas/NumPy).
    #[inline]
    pub fn eval(self, x: f64, v: f64) -> bool {
        match self {
            Op::Gt => x > v,
            Op::Ge => x >= v,
            Op::Lt => x < v,
            Op::Le => x <= v,
            Op::Eq => x == v,
            Op::Ne => x != v,
        }
    }
}

/// Which columns `--standardize` applies to.
#[derive(Clone, Debug, PartialEq)]
pub enum Selector {
    /// Every integer or float column.
    Numeric,
    /// These columns.
    Columns(Vec<String>),
}

/// One cleaning step, as written on the command line.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// Drop rows with a null or NaN in any column.
    DropNa,
    /// Keep rows where `column op value` holds (null/NaN: false, except `!=`: true).
    Filter {
        /// Column name.
        column: String,
        /// Comparison.
        op: Op,
        /// Literal compared against.
        value: f64,
    },
    /// `(x - mean) / std` with statistics over the rows surviving the earlier steps.
    Standardize(Selector),
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::DropNa => write!(f, "dropna"),
            Step::Filter { column, op, value } => {
                write!(
                    f,
                    "filter({} {} {value:?})",
                    quote_column(column),
                    op.as_str()
                )
            }
            Step::Standardize(Selector::Numeric) => write!(f, "standardize(numeric)"),
            Step::Standardize(Selector::Columns(c)) => write!(f, "standardize({})", c.join(",")),
        }
    }
}

/// Characters that end a bare (unquoted) column name in a `--filter`.
const OP_CHARS: [char; 4] = ['>', '<', '=', '!'];

/// Whether `name` must be quoted to be written in a `--filter` (it holds an operator
/// character, a quote, or leading/trailing space, or is empty).
fn needs_quotes(name: &str) -> bool {
    name.is_empty() || name.trim() != name || name.contains(OP_CHARS) || name.contains(['"', '`'])
}

/// `name` as it is written in a `--filter`: bare, or double-quoted with `""` for a quote.
pub fn quote_column(name: &str) -> String {
    if needs_quotes(name) {
        format!("\"{}\"", name.replace('"', "\"\""))
    } else {
        name.to_string()
    }
}

/// Parses `COL OP VALUE` (spaces optional), e.g. `value > 0` or `temp<=-3.5`.
///
/// A column name holding an operator character, spaces at its ends or quotes is written
/// quoted: `"a>b" > 0` (a `"` inside doubled, as in CSV) or `` `a>b` > 0`` (pandas' `query`
/// spelling, a backtick inside doubled). A bare name runs up to the first of `> < = !`.
pub fn parse_filter(text: &str) -> Result<Step, CleanError> {
    let usage = |why: &str| {
        CleanError::Usage(format!(
            "--filter '{text}': {why}; expected 'COLUMN OP NUMBER' with OP one of > >= < <= == != \
             (e.g. --filter 'value > 0'; quote a column name that holds > < = ! or spaces at \
             its ends: --filter '\"a>b\" > 0')"
        ))
    };
    let trimmed = text.trim_start();
    let (column, rest) = match trimmed.chars().next() {
        Some(q @ ('"' | '`')) => {
            // Quoted name: up to the closing quote; a doubled quote stands for one.
            let body = &trimmed[1..];
            let mut name = String::new();
            let mut chars = body.char_indices().peekable();
            let mut end = None;
            while let Some((i, c)) = chars.next() {
                if c == q {
                    if chars.peek().map(|&(_, n)| n) == Some(q) {
                        name.push(q);
                        chars.next();
                        continue;
                    }
                    end = Some(i + 1);
                    break;
                }
                name.push(c);
            }
            let end = end.ok_or_else(|| usage(&format!("the column name's {q} is not closed")))?;
            let rest = body[end..].trim_start();
            if !rest.starts_with(OP_CHARS) {
                return Err(usage(&format!(
                    "expected an operator after the column {q}{name}{q}, found '{rest}'"
                )));
            }
            (name, rest)
        }
        _ => {
            let pos = trimmed
                .find(OP_CHARS)
                .ok_or_else(|| usage("no comparison operator"))?;
            let column = trimmed[..pos].trim();
            if column.is_empty() {
                return Err(usage("missing column name before the operator"));
            }
            (column.to_string(), &trimmed[pos..])
        }
    };
    let (op, len) = if rest.starts_with(">=") {
        (Op::Ge, 2)
    } else if rest.starts_with("<=") {
        (Op::Le, 2)
    } else if rest.starts_with("==") {
        (Op::Eq, 2)
    } else if rest.starts_with("!=") {
        (Op::Ne, 2)
    } else if rest.starts_with('>') {
        (Op::Gt, 1)
    } else if rest.starts_with('<') {
        (Op::Lt, 1)
    } else {
        return Err(usage(&format!(
            "'{}' is not an operator (use == for equality)",
            rest.chars().next().unwrap_or(' ')
        )));
    };
    let literal = rest[len..].trim();
    if literal.is_empty() {
        return Err(usage(&format!("no number after '{}'", op.as_str())));
    }
    let value: f64 = literal.parse().map_err(|_| {
        if literal.contains(OP_CHARS) || literal.contains(char::is_whitespace) {
            usage(&format!(
                "read as column '{column}', operator '{}' and value '{literal}', which is not a \
                 number — if the column's name is '{}', quote it",
                op.as_str(),
                text.trim()
                    .rsplit_once(|c: char| OP_CHARS.contains(&c))
                    .map(|(l, _)| l.trim_end_matches(OP_CHARS).trim())
                    .unwrap_or(text.trim())
            ))
        } else {
            usage(&format!("'{literal}' is not a number"))
        }
    })?;
    Ok(Step::Filter { column, op, value })
}

/// Parses the `--standardize` value: `numeric` or `COL,COL,...`.
pub fn parse_selector(text: &str) -> Result<Selector, CleanError> {
    let text = text.trim();
    if text.eq_ignore_ascii_case("numeric") {
        return Ok(Selector::Numeric);
    }
    let cols: Vec<String> = text
        .split(',')
        .map(|c| c.trim().to_string())
        .filter(|c| !c.is_empty())
        .collect();
    if cols.is_empty() {
        return Err(CleanError::Usage(
            "--standardize needs 'numeric' or a comma-separated list of columns".into(),
        ));
    }
    Ok(Selector::Columns(cols))
}

/// True for the types pandas calls numeric (integers and floats, not booleans).
pub fn is_numeric(dt: &DataType) -> bool {
    dt.is_integer() || dt.is_floating()
}

/// A plan checked against a schema: column indices resolved.
#[derive(Clone, Debug)]
pub struct Resolved {
    /// Steps in order, with filter columns resolved to indices.
    pub steps: Vec<ResolvedStep>,
    /// Index in `steps` of the standardize step, if any.
    pub standardize_at: Option<usize>,
    /// Columns standardized (indices into the working schema), in schema order.
    pub standardized: Vec<usize>,
}

/// A step with its columns resolved.
#[derive(Clone, Debug)]
pub enum ResolvedStep {
    /// Drop rows with a null/NaN in any column.
    DropNa,
    /// Keep rows where column `col` compares true.
    Filter {
        /// Column index.
        col: usize,
        /// Comparison.
        op: Op,
        /// Literal.
        value: f64,
    },
    /// Standardize the plan's `standardized` columns.
    Standardize,
}

/// Checks every step against `schema` (the columns after `--columns`): filter columns must
/// exist and be numeric, standardized columns too. Fails with a usage error naming the column.
pub fn resolve(steps: &[Step], schema: &Schema) -> Result<Resolved, CleanError> {
    let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
    let lookup = |col: &str, what: &str| -> Result<usize, CleanError> {
        let idx = schema.index_of(col).map_err(|_| {
            CleanError::Usage(format!(
                "{what}: no column '{col}' in the input (columns: {})",
                names.join(", ")
            ))
        })?;
        let dt = schema.field(idx).data_type();
        if !is_numeric(dt) {
            return Err(CleanError::Usage(format!(
                "{what}: column '{col}' is not numeric (it is {dt}); only integer and float \
                 columns can be compared or standardized"
            )));
        }
        Ok(idx)
    };
    let mut out = Vec::with_capacity(steps.len());
    let mut standardize_at = None;
    let mut standardized = Vec::new();
    for (i, step) in steps.iter().enumerate() {
        out.push(match step {
            Step::DropNa => ResolvedStep::DropNa,
            Step::Filter { column, op, value } => ResolvedStep::Filter {
                col: lookup(
                    column,
                    &format!(
                        "--filter '{} {} {value}'",
                        quote_column(column),
                        op.as_str()
                    ),
                )?,
                op: *op,
                value: *value,
            },
            Step::Standardize(sel) => {
                if standardize_at.is_some() {
                    return Err(CleanError::Usage("--standardize may be given once".into()));
                }
                standardize_at = Some(i);
                standardized = match sel {
                    Selector::Numeric => schema
                        .fields()
                        .iter()
                        .enumerate()
                        .filter(|(_, f)| is_numeric(f.data_type()))
                        .map(|(i, _)| i)
                        .collect(),
                    Selector::Columns(cols) => {
                        let mut idx = cols
                            .iter()
                            .map(|c| lookup(c, "--standardize"))
                            .collect::<Result<Vec<_>, _>>()?;
                        idx.sort_unstable();
                        idx.dedup();
                        idx
                    }
                };
                ResolvedStep::Standardize
            }
        });
    }
    Ok(Resolved {
        steps: out,
        standardize_at,
        standardized,
    })
}

/// The plan as one line (recorded in `_stats.json` so that statistics are only reused by the
/// same plan).
pub fn describe(steps: &[Step], columns: &[String]) -> String {
    let mut parts: Vec<String> = Vec::new();
    if !columns.is_empty() {
        parts.push(format!("columns({})", columns.join(",")));
    }
    parts.extend(steps.iter().map(|s| s.to_string()));
    parts.join(" | ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::datatypes::Field;

    #[test]
    fn filters_parse() {
        assert_eq!(
            parse_filter("value > 0").expect("test"),
            Step::Filter {
                column: "value".into(),
                op: Op::Gt,
                value: 0.0
            }
        );
        assert_eq!(
            parse_filter("temp<=-3.5").expect("test"),
            Step::Filter {
                column: "temp".into(),
                op: Op::Le,
                value: -3.5
            }
        );
        assert!(matches!(
            parse_filter("a != 1e3").expect("test"),
            Step::Filter { op: Op::Ne, .. }
        ));
        assert!(parse_filter("value = 1").is_err());
        assert!(parse_filter("value > abc").is_err());
        assert!(parse_filter("> 3").is_err());
        assert!(parse_filter("value").is_err());
    }

    #[test]
    fn filter_column_names_with_operators_are_quoted() {
        let f = |t: &str| match parse_filter(t).expect(t) {
            Step::Filter { column, op, value } => (column, op, value),
            other => panic!("{other:?}"),
        };
        assert_eq!(f("\"a>b\" > 0"), ("a>b".into(), Op::Gt, 0.0));
        assert_eq!(f("`a b` <= -1"), ("a b".into(), Op::Le, -1.0));
        assert_eq!(
            f("\"say \"\"hi\"\"\"!=2"),
            ("say \"hi\"".into(), Op::Ne, 2.0)
        );
        assert_eq!(f("  \" padded \" == 1"), (" padded ".into(), Op::Eq, 1.0));
        // The name prints back quoted, so the plan text stays unambiguous.
        let step = parse_filter("\"a>b\" > 0").expect("test");
        assert_eq!(step.to_string(), "filter(\"a>b\" > 0.0)");
        assert_eq!(
            parse_filter(&step.to_string()[7..step.to_string().len() - 1]).expect("t"),
            step
        );
    }

    #[test]
    fn filter_errors_name_the_problem() {
        let e = |t: &str| parse_filter(t).expect_err(t).to_string();
        // The audit's case: an unquoted name holding '>' used to say "'b > 0' is not a number".
        let m = e("a>b > 0");
        assert!(m.contains("if the column's name is 'a>b', quote it"), "{m}");
        assert!(m.contains("\"a>b\" > 0"), "{m}");
        assert!(e("\"a>b > 0").contains("not closed"));
        assert!(e("value = 1").contains("use == for equality"));
        assert!(e("value >").contains("no number after '>'"));
        assert!(e("value > abc").contains("'abc' is not a number"));
        assert!(e("\"a\" b > 1").contains("expected an operator after the column"));
    }

    #[test]
    fn nan_compares_like_numpy() {
        assert!(!Op::Gt.eval(f64::NAN, 0.0));
        assert!(!Op::Eq.eval(f64::NAN, f64::NAN));
        assert!(Op::Ne.eval(f64::NAN, 0.0));
    }

    #[test]
    fn resolve_rejects_missing_and_non_numeric() {
        let schema = Schema::new(vec![
            Field::new("value", DataType::Float64, true),
            Field::new("name", DataType::Utf8, true),
            Field::new("n", DataType::Int64, true),
        ]);
        let e =
            resolve(&[parse_filter("nope > 1").expect("test")], &schema).expect_err("must fail");
        assert!(e.to_string().contains("no column 'nope'"), "{e}");
        let e =
            resolve(&[parse_filter("name > 1").expect("test")], &schema).expect_err("must fail");
        assert!(e.to_string().contains("not numeric"), "{e}");
        let r = resolve(&[Step::Standardize(Selector::Numeric)], &schema).expect("test");
        assert_eq!(r.standardized, vec![0, 2]);
    }
}
