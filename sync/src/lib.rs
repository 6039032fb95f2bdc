//! Crash-safe synchronisation of job outputs from node-local scratch to persistent storage.
//!
//! Filled in by the job-lifecycle issue.
