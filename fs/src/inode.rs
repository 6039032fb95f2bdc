//! Inode numbers: source nodes are their snapshot id + 1 (the root, node 0, is inode 1 as FUSE
//! requires), virtual nodes (`.stagefs/`, `.npy/…`) are numbered from [`VIRTUAL_BASE`] on first
//! lookup and kept for the life of the mount.
//!
//! Snapshot ids are dense `u32`s, so the two ranges never meet, and a source inode number costs
//! nothing to keep: the mapping is arithmetic. Virtual numbers are few (one per view file).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::RwLock;

use crate::snapshot::NodeId;
use stagefs_prefetch::locks;

/// Inode number of the mount's root.
pub const ROOT_INO: u64 = 1;
/// First virtual inode number: above every `u32` snapshot id.
pub const VIRTUAL_BASE: u64 = 1 << 40;

/// What a virtual inode stands for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Virtual {
    /// `.stagefs/`.
    ControlDir,
    /// `.stagefs/stats`.
    Stats,
    /// A directory under `.npy/` (path relative to `.npy/`; empty for `.npy/` itself).
    ViewDir(PathBuf),
    /// A file under `.npy/` (path relative to `.npy/`).
    ViewFile(PathBuf),
}

/// What an inode number stands for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Node {
    /// A node of the source snapshot.
    Source(NodeId),
    /// A virtual node.
    Virtual(Virtual),
}

/// The inode number of snapshot node `id`.
pub fn source_ino(id: NodeId) -> u64 {
    u64::from(id) + 1
}

/// Two-way map between virtual inode numbers and virtual nodes.
#[derive(Default)]
pub struct InodeTable {
    inner: RwLock<Tables>,
}

#[derive(Default)]
struct Tables {
    nodes: Vec<Virtual>,
    by_node: HashMap<Virtual, u64>,
}

impl InodeTable {
    /// The node of `ino`.
    pub fn get(&self, ino: u64) -> Option<Node> {
        if ino < VIRTUAL_BASE {
            let id = ino.checked_sub(1)?;
            return Some(Node::Source(u32::try_from(id).ok()?));
        }
        let t = locks::read(&self.inner);
        let i = usize::try_from(ino - VIRTUAL_BASE).ok()?;
        t.nodes.get(i).cloned().map(Node::Virtual)
    }

    /// The inode number of virtual node `node`, assigning one if it has none.
    pub fn ino(&self, node: Virtual) -> u64 {
        if let Some(ino) = locks::read(&self.inner).by_node.get(&node) {
            return *ino;
        }
        let mut t = locks::write(&self.inner);
        if let Some(ino) = t.by_node.get(&node) {
            return *ino;
        }
        let ino = VIRTUAL_BASE + t.nodes.len() as u64;
        t.nodes.push(node.clone());
        t.by_node.insert(node, ino);
        ino
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_and_virtual_numbers_do_not_meet() {
        let t = InodeTable::default();
        assert_eq!(t.get(ROOT_INO), Some(Node::Source(0)));
        assert_eq!(t.get(source_ino(u32::MAX)), Some(Node::Source(u32::MAX)));
        let s = t.ino(Virtual::Stats);
        assert!(s >= VIRTUAL_BASE);
        assert_eq!(t.get(s), Some(Node::Virtual(Virtual::Stats)));
        assert_eq!(t.ino(Virtual::Stats), s);
        assert_eq!(t.get(0), None);
        assert_eq!(t.get(VIRTUAL_BASE + 99), None);
    }
}
