//! One module per subcommand: argument parsing and wiring to the library crates.

pub mod convert;
pub mod convert_npy;
pub mod convert_parquet;
pub mod index;
pub mod logging;
pub mod mount;
pub mod preload;
pub mod run;
pub mod stat;
pub mod stream;
pub mod sync;
pub mod units;
