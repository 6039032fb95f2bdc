//! `stagefs convert`'s arguments: the offline conversions. `--to npy` writes the tensor views
//! as real files (`convert_npy`); `--to parquet` is the table-cleaning job (`convert_parquet`).
//! Each of those takes these arguments; `main` picks one by `--to`.

use std::path::PathBuf;

use clap::ValueEnum;

/// Output format of `stagefs convert`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Target {
    /// The mount's `.npy/` tensor views, written as real files (byte-identical).
    Npy,
    /// Cleaned tables (dropna, filters, standardize) written as Parquet.
    Parquet,
}

/// Arguments of `stagefs convert`.
#[derive(clap::Args, Debug)]
#[command(after_long_help = "Examples:\n  \
    stagefs convert /bigdata/raw /bigdata/npy --to npy --image-size 224\n  \
    stagefs convert '/bigdata/raw/*.csv' /bigdata/clean --to parquet --dropna \\\n      \
    --filter 'value > 0' --standardize numeric")]
pub struct Args {
    /// Inputs: for --to npy one or more dataset directories (each an ImageFolder root and/or a
    /// tree of tables); for --to parquet table files, directories or quoted globs.
    #[arg(required = true, num_args = 1.., value_name = "SRC")]
    pub inputs: Vec<String>,
    /// The output directory.
    #[arg(required = true, value_name = "OUT")]
    pub out: PathBuf,
    /// Output format.
    #[arg(long, value_enum)]
    pub to: Target,
    #[command(flatten)]
    pub image: ImageArgs,
    /// --to npy: also write the image views of every subdirectory (each class folder and
    /// every level in between), as the mount shows them. Default: the image view of each SRC
    /// only (tables are written at every level either way).
    #[arg(long)]
    pub all_levels: bool,
    /// Exit with status 0 even if some inputs are bad. They are listed either way, and the
    /// outputs are written either way (a bad image is a zero slot, a bad table is skipped);
    /// without this flag the exit status is 1 when anything was listed.
    #[arg(long)]
    pub allow_bad: bool,
    /// Worker threads (default: one per core the job may use: its affinity mask and cgroup quota).
    #[arg(long, short = 'j')]
    pub jobs: Option<usize>,
    /// Parquet: drop rows with a null/NaN in any (selected) column. Order-sensitive step.
    #[arg(long)]
    pub dropna: bool,
    /// Parquet: keep rows where `COL OP VALUE` holds (OP: > >= < <= == !=). Repeatable.
    #[arg(long = "filter", value_name = "'COL OP VALUE'")]
    pub filters: Vec<String>,
    /// Parquet: standardize `(x - mean) / std` (ddof=1): `numeric` or a list `COL,COL`.
    #[arg(long)]
    pub standardize: Option<String>,
    /// Parquet: keep only these columns (comma-separated), in this order.
    #[arg(long, value_delimiter = ',')]
    pub columns: Vec<String>,
    /// Parquet: compression codec of the output.
    #[arg(long, default_value = "zstd")]
    pub compression: String,
    /// Process only shard I of N (0-based) of the input files, for SLURM job arrays.
    #[arg(long, value_name = "I/N")]
    pub shard: Option<String>,
    /// Parquet: only compute statistics for this shard and write them to OUT/_stats.shard-I.json.
    #[arg(long)]
    pub stats_only: bool,
    /// Parquet: merge OUT/_stats.shard-*.json into OUT/_stats.json (after a --stats-only array).
    #[arg(long)]
    pub merge_stats: bool,
    /// Parquet: what to do with malformed CSV rows.
    #[arg(long, default_value = "error", value_parser = ["skip", "error"])]
    pub bad_rows: String,
    /// Parquet: memory budget for the whole job (bytes, or with a K/M/G suffix): sets the
    /// size of the units read at once and of the cache that saves re-parsing in pass 2.
    #[arg(long, default_value = "1G", value_parser = super::units::parse_size)]
    pub memory_budget: u64,
    /// Hide the progress bar.
    #[arg(long, short = 'q')]
    pub quiet: bool,
}

impl Args {
    /// The inputs and the output directory.
    pub fn inputs_and_out(&self) -> (&[String], PathBuf) {
        (&self.inputs, self.out.clone())
    }
}

/// The image-view flags, the same for `convert` and `mount` (the mount's views equal converted
/// files only if both are given the same).
#[derive(clap::Args, Debug, Clone)]
pub struct ImageArgs {
    /// Image views: side S of the S×S crops (shorter side resized to S, then center crop);
    /// 1..=8192.
    #[arg(long, default_value_t = stagefs_views::view::DEFAULT_IMAGE_SIZE, value_parser = parse_image_size)]
    pub image_size: u32,
    /// Image views: decode JPEGs at a reduced scale in the DCT domain (the smallest M/8 that
    /// keeps the shorter side ≥ S), then resize: about twice as fast, a few levels from Pillow.
    /// Default: exact (Pillow's pixels). Give `mount` and `convert` the same.
    #[arg(long)]
    pub fast_decode: bool,
    /// Image views: largest image accepted, in pixels (width × height; K/M/G suffixes are
    /// powers of 1024); larger images are bad inputs (zero slots, listed as errors).
    #[arg(long, default_value = "64M", value_parser = super::units::parse_size)]
    pub max_image_pixels: u64,
    /// Image views: pixels all decodes in flight may hold at once (~3 bytes a pixel; bounds
    /// memory whatever the threads; an image that cannot fit is decoded at a reduced scale or
    /// reported as bad); at least 1M.
    #[arg(long, default_value = "32M", value_parser = super::units::parse_size)]
    pub decode_budget: u64,
}

/// Parses and range-checks `--image-size`.
pub fn parse_image_size(text: &str) -> Result<u32, String> {
    let n: u64 = text
        .trim()
        .parse()
        .map_err(|_| format!("'{text}' is not a whole number of pixels"))?;
    stagefs_views::view::check_image_size(n)
}
