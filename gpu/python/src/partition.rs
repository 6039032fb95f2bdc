//! The node-partitioned order of `stagefs-gpu` ([`stagefs_gpu::partition`]) as functions of
//! `stagefs._native`, so `stagefs.torch.DistributedSampler` visits users' own Datasets in the
//! same order as `stagefs.Loader` — one implementation, not two.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use stagefs_gpu::partition::{self, Grid, NodeOrder, Segment};

/// One earlier run of an epoch, as Python passes it: `(nodes, local_world_size, consumed)`.
pub(crate) type SegmentArgs = (u64, u64, u64);

/// The runs as the core takes them.
pub(crate) fn segments(before: Vec<SegmentArgs>) -> Vec<Segment> {
    before
        .into_iter()
        .map(|(nodes, local_world_size, consumed)| Segment {
            nodes,
            local_world_size,
            consumed,
        })
        .collect()
}

/// Where chunks are cut, as Python passes it: `(offset, row_bytes, chunk_bytes)`.
type GridArgs = (u64, u64, u64);

fn spec(rows: u64, shuffle: bool, seed: u64, exchange: f64, grid: GridArgs) -> PyResult<NodeOrder> {
    let (offset, row_bytes, chunk_bytes) = grid;
    if row_bytes == 0 || chunk_bytes == 0 {
        return Err(PyValueError::new_err(format!(
            "grid {grid:?}: row_bytes and chunk_bytes must be at least 1"
        )));
    }
    if !(0.0..=1.0).contains(&exchange) {
        return Err(PyValueError::new_err(format!(
            "exchange={exchange} is not in [0, 1]"
        )));
    }
    Ok(NodeOrder {
        rows,
        shuffle,
        seed,
        exchange,
        grid: Grid {
            offset,
            row_bytes,
            chunk_bytes,
        },
    })
}

/// `node_order(rows, shuffle, seed, exchange, grid, epoch, nodes, local_world_size, rank,
/// before=[])`: the rows `rank` visits in `epoch` (after the runs `before` of it); `grid` is
/// `(offset, row_bytes, chunk_bytes)`, `(0, 1, C)` for chunks of C samples.
#[pyfunction]
#[pyo3(signature = (rows, shuffle, seed, exchange, grid, epoch, nodes, local_world_size, rank, before=Vec::new()))]
#[allow(clippy::too_many_arguments)]
fn node_order(
    py: Python<'_>,
    rows: u64,
    shuffle: bool,
    seed: u64,
    exchange: f64,
    grid: GridArgs,
    epoch: u64,
    nodes: u64,
    local_world_size: u64,
    rank: u64,
    before: Vec<SegmentArgs>,
) -> PyResult<Vec<u64>> {
    let o = spec(rows, shuffle, seed, exchange, grid)?;
    if nodes == 0 || local_world_size == 0 || rank >= nodes.saturating_mul(local_world_size) {
        return Err(PyValueError::new_err(format!(
            "rank {rank} is not in 0..{nodes} nodes x {local_world_size}"
        )));
    }
    let before = segments(before);
    Ok(
        py.detach(|| {
            partition::node_epoch_order(&o, epoch, &before, nodes, local_world_size, rank)
        }),
    )
}

/// `node_ranges(rows, seed, exchange, grid, epoch, nodes, node)`: the row ranges
/// `[(start, end)]` node `node` reads in `epoch`, sorted and merged.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn node_ranges(
    rows: u64,
    seed: u64,
    exchange: f64,
    grid: GridArgs,
    epoch: u64,
    nodes: u64,
    node: u64,
) -> PyResult<Vec<(u64, u64)>> {
    let o = spec(rows, true, seed, exchange, grid)?;
    Ok(partition::node_ranges(&o, epoch, nodes, node)
        .into_iter()
        .map(|r| (r.start, r.end))
        .collect())
}

/// Adds the functions to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(node_order, m)?)?;
    m.add_function(wrap_pyfunction!(node_ranges, m)?)?;
    Ok(())
}
