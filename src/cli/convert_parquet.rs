//! `stagefs convert --to parquet`: the table-cleaning job (dropna, filters, standardize) as a
//! thin layer over `stagefs_clean`.
//!
//! Steps apply in command-line order, which clap's derived struct does not keep (it groups
//! values per flag), so the order is recovered from clap's own argument indices by parsing the
//! same command line again with the same definition (`indices_of`): quoting, `--flag=value` and
//! abbreviations are handled exactly as clap handled them the first time.
//!
//! The progress bar shows input bytes/s and rows/s per pass; it is hidden with `-q` or when
//! stderr is not a terminal, and a one-line summary is printed instead (batch logs stay clean).

use std::ffi::OsString;
use std::io::IsTerminal;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args as _, FromArgMatches as _};
use indicatif::{HumanBytes, ProgressBar, ProgressStyle};
use stagefs_clean::{
    parse_filter, parse_selector, BadRows, CleanError, CleanOptions, Codec, Mode, Progress, Shard,
    Step,
};

use super::convert::Args;

/// Steps in the order given on `argv` (the arguments after the `convert` subcommand).
pub fn ordered_steps(argv: &[OsString], args: &Args) -> anyhow::Result<Vec<Step>> {
    let cmd = Args::augment_args(clap::Command::new("convert").no_binary_name(true));
    let matches = cmd
        .try_get_matches_from(argv)
        .context("re-reading the command line for the step order")?;
    // Sanity: this parse must agree with the one that built `args`.
    let again = Args::from_arg_matches(&matches)?;
    anyhow::ensure!(
        again.filters == args.filters
            && again.dropna == args.dropna
            && again.standardize == args.standardize,
        "internal: step arguments differ between parses"
    );
    let mut keyed: Vec<(usize, Step)> = Vec::new();
    // A flag's default (`false`) has an index too: only a given flag is a step.
    if let (true, Some(mut idx)) = (args.dropna, matches.indices_of("dropna")) {
        if let Some(i) = idx.next() {
            keyed.push((i, Step::DropNa));
        }
    }
    if let Some(idx) = matches.indices_of("filters") {
        for (i, text) in idx.zip(&args.filters) {
            keyed.push((i, parse_filter(text)?));
        }
    }
    if let (Some(mut idx), Some(text)) = (matches.indices_of("standardize"), &args.standardize) {
        if let Some(i) = idx.next() {
            keyed.push((i, Step::Standardize(parse_selector(text)?)));
        }
    }
    keyed.sort_by_key(|(i, _)| *i);
    Ok(keyed.into_iter().map(|(_, s)| s).collect())
}

/// The arguments after `convert` on this process's command line.
fn convert_argv() -> Vec<OsString> {
    let argv: Vec<OsString> = std::env::args_os().collect();
    let pos = argv
        .iter()
        .skip(1)
        .position(|a| a == "convert")
        .map(|p| p + 2)
        .unwrap_or(argv.len());
    argv[pos.min(argv.len())..].to_vec()
}

fn bar_style(phase: &str) -> ProgressStyle {
    ProgressStyle::with_template(&format!(
        "{phase:>10} [{{bar:30}}] {{bytes}}/{{total_bytes}} {{bytes_per_sec}} {{msg}} eta {{eta}}"
    ))
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ")
}

/// Written when an allocation fails: Rust's allocation-error handler prints the size and
/// aborts, and an abort is not how a batch job should fail.
const OOM_MESSAGE: &[u8] =
    b"stagefs: error: out of memory (an allocation failed; check `ulimit -v` \
and the job's memory limit, or lower --memory-budget or -j)\n";

/// Turns an abort (a failed allocation ends in `abort()`) into a message and exit status 1.
fn exit_1_on_abort() {
    extern "C" fn on_abort(_: libc::c_int) {
        // SAFETY: write(2) and _exit(2) are async-signal-safe; the buffer is a static.
        unsafe {
            libc::write(2, OOM_MESSAGE.as_ptr().cast(), OOM_MESSAGE.len());
            libc::_exit(1);
        }
    }
    // SAFETY: a zeroed sigaction with a handler that only calls async-signal-safe functions.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_abort as extern "C" fn(libc::c_int) as libc::sighandler_t;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(libc::SIGABRT, &action, std::ptr::null_mut());
    }
}

/// Runs the conversion; returns the process exit code (2 for a usage error, reported before
/// any data is read). A failed allocation or a panic anywhere in the job ends it with a
/// message and status 1, never an abort or a hang.
pub fn run(args: &Args) -> anyhow::Result<i32> {
    exit_1_on_abort();
    let result = match stagefs_clean::caught(|| Ok(run_inner(args))) {
        Ok(r) => r,
        Err(panicked) => Err(panicked.into()),
    };
    match result {
        Err(e) if matches!(e.downcast_ref::<CleanError>(), Some(CleanError::Usage(_))) => {
            eprintln!("stagefs: error: {e:#}");
            Ok(2)
        }
        other => other,
    }
}

fn run_inner(args: &Args) -> anyhow::Result<i32> {
    let (inputs, out) = args.inputs_and_out();
    let steps = ordered_steps(&convert_argv(), args)?;
    let mode = match (args.stats_only, args.merge_stats) {
        (true, true) => anyhow::bail!("--stats-only and --merge-stats are separate steps"),
        (true, false) => Mode::StatsOnly,
        (false, true) => Mode::MergeStats,
        (false, false) => Mode::Convert,
    };
    let opts = CleanOptions {
        inputs: inputs.to_vec(),
        out,
        steps,
        columns: args.columns.clone(),
        codec: args.compression.parse::<Codec>()?,
        shard: args.shard.as_deref().map(str::parse::<Shard>).transpose()?,
        mode,
        bad_rows: if args.bad_rows == "skip" {
            BadRows::Skip
        } else {
            BadRows::Error
        },
        memory_budget: args.memory_budget,
        threads: args.jobs.unwrap_or(0),
        scratch: None,
    };
    let progress = Progress::default();
    let show = !args.quiet && std::io::stderr().is_terminal();
    let started = Instant::now();
    let done = std::sync::atomic::AtomicBool::new(false);
    let result = std::thread::scope(|scope| {
        let ticker = show.then(|| {
            let progress = &progress;
            let done = &done;
            scope.spawn(move || {
                let mut bar: Option<(u8, ProgressBar, Instant)> = None;
                while !done.load(Ordering::Relaxed) {
                    let phase = progress.phase.load(Ordering::Relaxed);
                    if phase == 1 || phase == 2 {
                        if bar.as_ref().is_none_or(|(p, _, _)| *p != phase) {
                            if let Some((_, b, _)) = bar.take() {
                                b.finish();
                            }
                            let b = ProgressBar::new(progress.total_bytes.load(Ordering::Relaxed));
                            b.set_style(bar_style(if phase == 1 {
                                "statistics"
                            } else {
                                "writing"
                            }));
                            bar = Some((phase, b, Instant::now()));
                        }
                        if let Some((_, b, t)) = &bar {
                            let rows = progress.rows.load(Ordering::Relaxed);
                            b.set_position(progress.bytes.load(Ordering::Relaxed));
                            let secs = t.elapsed().as_secs_f64().max(1e-3);
                            b.set_message(format!("{:.2} Mrows/s", rows as f64 / secs / 1e6));
                        }
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                if let Some((_, b, _)) = bar {
                    b.finish_and_clear();
                }
            })
        });
        let r = stagefs_clean::run(&opts, &progress);
        done.store(true, Ordering::Relaxed);
        if let Some(t) = ticker {
            let _ = t.join();
        }
        r
    });
    let summary = result?;
    let secs = started.elapsed().as_secs_f64().max(1e-3);
    for e in &summary.bad_row_examples {
        eprintln!("stagefs: skipped malformed row: {e}");
    }
    if mode == Mode::MergeStats {
        eprintln!(
            "stagefs: merged statistics of {} inputs into {}",
            summary.files,
            summary
                .written
                .first()
                .map(|p| p.display().to_string())
                .unwrap_or_default()
        );
    } else {
        eprintln!(
            "stagefs: {} files, {} in {:.1}s ({}/s, {:.2} Mrows/s, {} pass{}): {} rows read, {} \
             written{}",
            summary.files,
            HumanBytes(summary.input_bytes),
            secs,
            HumanBytes(
                (summary.input_bytes as f64 * f64::from(summary.passes.max(1)) / secs) as u64
            ),
            summary.rows_read as f64 * f64::from(summary.passes.max(1)) / secs / 1e6,
            summary.passes,
            if summary.passes == 1 { "" } else { "es" },
            summary.rows_read,
            summary.rows_written,
            if summary.bad_rows > 0 {
                format!(", {} malformed rows skipped", summary.bad_rows)
            } else {
                String::new()
            }
        );
        if summary.spilled.1 > 0 {
            eprintln!(
                "stagefs: pass 1 kept {} units for pass 2 ({} spilled to scratch, {})",
                summary.cached_units,
                summary.spilled.1,
                HumanBytes(summary.spilled.0)
            );
        }
    }
    if !args.quiet {
        for (name, mean, std) in &summary.stats {
            eprintln!("stagefs:   {name}: mean {mean} std {std}");
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        args: Args,
    }

    fn steps(line: &[&str]) -> Vec<Step> {
        let argv: Vec<OsString> = line.iter().map(OsString::from).collect();
        let w = Wrap::try_parse_from(std::iter::once(OsString::from("x")).chain(argv.clone()))
            .expect("test");
        ordered_steps(&argv, &w.args).expect("test")
    }

    #[test]
    fn steps_keep_command_line_order() {
        let a = steps(&[
            "in",
            "out",
            "--to",
            "parquet",
            "--filter",
            "value > 0",
            "--dropna",
            "--standardize=numeric",
            "--filter",
            "temp < 1",
        ]);
        let shown: Vec<String> = a.iter().map(|s| s.to_string()).collect();
        assert_eq!(
            shown,
            [
                "filter(value > 0.0)",
                "dropna",
                "standardize(numeric)",
                "filter(temp < 1.0)"
            ]
        );
        let b = steps(&[
            "--standardize",
            "a,b",
            "--dropna",
            "in",
            "out",
            "--to",
            "parquet",
        ]);
        assert!(matches!(b[0], Step::Standardize(_)));
        assert_eq!(b[1], Step::DropNa);
    }
}
