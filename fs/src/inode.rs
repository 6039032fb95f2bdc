//! The inode table: stable inode numbers for source paths and virtual nodes.
//!
//! Numbers are handed out on first lookup and kept for the life of the mount (forget is
//! ignored): a dataset of a million files costs tens of megabytes here, and stable numbers keep
//! the kernel's caches and tools like `find` consistent.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::RwLock;

/// Inode number of the mount's root.
pub const ROOT: u64 = 1;

/// What an inode stands for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Node {
    /// A path in the source tree (`""` is the root).
    Source(PathBuf),
    /// `.stagefs/`.
    ControlDir,
    /// `.stagefs/stats`.
    Stats,
    /// A directory under `.npy/` (path relative to `.npy/`).
    ViewDir(PathBuf),
    /// A file under `.npy/` (path relative to `.npy/`).
    ViewFile(PathBuf),
}

/// Two-way map between inode numbers and nodes.
pub struct InodeTable {
    inner: RwLock<Tables>,
}

struct Tables {
    nodes: Vec<Node>,
    by_node: HashMap<Node, u64>,
}

impl Default for InodeTable {
    fn default() -> Self {
        let root = Node::Source(PathBuf::new());
        InodeTable {
            inner: RwLock::new(Tables {
                nodes: vec![root.clone()],
                by_node: HashMap::from([(root, ROOT)]),
            }),
        }
    }
}

impl InodeTable {
    /// The node of `ino`.
    pub fn get(&self, ino: u64) -> Option<Node> {
        let t = self.inner.read().unwrap_or_else(|p| p.into_inner());
        t.nodes
            .get(usize::try_from(ino).ok()?.checked_sub(1)?)
            .cloned()
    }

    /// The inode number of `node`, assigning one if it has none.
    pub fn ino(&self, node: Node) -> u64 {
        if let Some(ino) = self
            .inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .by_node
            .get(&node)
        {
            return *ino;
        }
        let mut t = self.inner.write().unwrap_or_else(|p| p.into_inner());
        if let Some(ino) = t.by_node.get(&node) {
            return *ino;
        }
        t.nodes.push(node.clone());
        let ino = t.nodes.len() as u64;
        t.by_node.insert(node, ino);
        ino
    }
}
