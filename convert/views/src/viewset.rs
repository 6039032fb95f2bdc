//! [`ViewSet`]: the whole `.npy/` namespace of one source, with the parsed metadata of every
//! table and image folder cached so that `stat`, `readdir` and repeated opens never re-parse.
//! This is what the mount holds; the free functions [`open_view`] and [`table_entries`] do the
//! same work without the caches.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::error::ViewError;
use crate::image::{image_file_view, images_len, ImagesView};
use crate::source::ByteSource;
use crate::table::Table;
use crate::tree::{ImageFolder, Node, TableFormat, ViewTree};
use crate::view::{View, ViewOptions};

/// What a path under `.npy/` is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ViewKind {
    /// A directory.
    Dir,
    /// A file of this many bytes.
    File(u64),
}

/// One entry of [`ViewSet::read_dir`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ViewEntry {
    /// Name within the directory.
    pub name: OsString,
    /// Directory or file (with its exact size).
    pub kind: ViewKind,
}

/// Why a table cannot be viewed, kept so that it is worked out (and reported) once.
#[derive(Clone)]
enum TableFailure {
    Corrupt(PathBuf, String),
    Unsupported(PathBuf, String),
}

impl TableFailure {
    fn error(&self) -> ViewError {
        match self.clone() {
            TableFailure::Corrupt(path, reason) => ViewError::Corrupt { path, reason },
            TableFailure::Unsupported(path, reason) => ViewError::Unsupported { path, reason },
        }
    }
}

type TableSlot = Arc<Mutex<Option<Result<Arc<Table>, TableFailure>>>>;

/// Bytes a cached failure counts for (its message and slot).
const FAILURE_BYTES: usize = 1024;

/// Open tables, least recently used first out once their metadata passes the view set's
/// budget (`ViewOptions::table_meta_bytes`).
struct Tables {
    map: lru::LruCache<PathBuf, (TableSlot, usize)>,
    bytes: usize,
}

/// The `.npy/` namespace of one source with cached metadata; cheap to share across threads.
pub struct ViewSet {
    src: Arc<dyn ByteSource>,
    tree: ViewTree,
    opts: ViewOptions,
    tables: Mutex<Tables>,
    folders: Mutex<HashMap<usize, Arc<ImageFolder>>>,
    images: Mutex<HashMap<usize, Arc<ImagesView>>>,
}

impl ViewSet {
    /// Scans `src` (directory listings only) and prepares its views.
    pub fn new(src: Arc<dyn ByteSource>, opts: ViewOptions) -> Result<ViewSet, ViewError> {
        let tree = ViewTree::scan(src.as_ref())?;
        Ok(ViewSet::with_tree(src, tree, opts))
    }

    /// Views of `src` over an already scanned `tree`; the tree's skipped entries are reported
    /// to `opts.on_bad` once, here.
    pub fn with_tree(src: Arc<dyn ByteSource>, tree: ViewTree, opts: ViewOptions) -> ViewSet {
        for (path, reason) in tree.skipped() {
            opts.report_bad(path, reason);
        }
        ViewSet {
            src,
            tree,
            opts,
            tables: Mutex::new(Tables {
                map: lru::LruCache::unbounded(),
                bytes: 0,
            }),
            folders: Mutex::new(HashMap::new()),
            images: Mutex::new(HashMap::new()),
        }
    }

    /// The scanned tree.
    pub fn tree(&self) -> &ViewTree {
        &self.tree
    }

    /// The source path (relative to the root) the view path `rel` derives from (the table
    /// file, or the image folder), for the view's owner and mode.
    pub fn source_of(&self, rel: &Path) -> Option<PathBuf> {
        self.tree.source_of(rel)
    }

    /// The options views are rendered with.
    pub fn options(&self) -> &ViewOptions {
        &self.opts
    }

    /// The opened table at source path `rel` (footer / CSV index parsed once, then cached;
    /// a corrupt or unsupported table's error is cached and reported to `on_bad` once, so a
    /// hostile file costs its parse once, not once per lookup).
    pub fn table(&self, rel: &Path, format: TableFormat) -> Result<Arc<Table>, ViewError> {
        let slot = {
            let mut tables = self.tables.lock().map_err(|_| poisoned())?;
            match tables.map.get(rel) {
                Some((slot, _)) => slot.clone(),
                None => {
                    let slot = TableSlot::default();
                    tables.map.put(rel.to_path_buf(), (slot.clone(), 0));
                    slot
                }
            }
        };
        let mut guard = slot.lock().map_err(|_| poisoned())?;
        match &*guard {
            Some(Ok(t)) => return Ok(t.clone()),
            Some(Err(failure)) => return Err(failure.error()),
            None => {}
        }
        let (result, bytes) = match Table::open(self.src.clone(), rel, format) {
            Ok(t) => {
                let t = Arc::new(t);
                *guard = Some(Ok(t.clone()));
                let bytes = t.meta_bytes();
                (Ok(t), bytes)
            }
            Err(ViewError::Corrupt { path, reason }) => {
                self.opts.report_bad(&path, &reason);
                let failure = TableFailure::Corrupt(path, reason);
                *guard = Some(Err(failure.clone()));
                (Err(failure.error()), FAILURE_BYTES)
            }
            Err(ViewError::Unsupported { path, reason }) => {
                self.opts.report_bad(&path, &reason);
                let failure = TableFailure::Unsupported(path, reason);
                *guard = Some(Err(failure.clone()));
                (Err(failure.error()), FAILURE_BYTES)
            }
            Err(e) => return Err(e),
        };
        drop(guard);
        self.account(rel, &slot, bytes)?;
        result
    }

    /// Counts `bytes` for the table at `rel` (held in `slot`) and drops the least recently
    /// used other tables while the total passes the budget. A dropped table's memory goes
    /// once no open view holds it; it is parsed again when next used.
    fn account(&self, rel: &Path, slot: &TableSlot, bytes: usize) -> Result<(), ViewError> {
        let mut tables = self.tables.lock().map_err(|_| poisoned())?;
        let tables = &mut *tables;
        match tables.map.get_mut(rel) {
            Some((s, counted)) if Arc::ptr_eq(s, slot) => {
                tables.bytes = tables.bytes - *counted + bytes;
                *counted = bytes;
            }
            // Dropped meanwhile by another table's accounting: not held, not counted.
            _ => return Ok(()),
        }
        while tables.bytes > self.opts.table_meta_bytes && tables.map.len() > 1 {
            let Some((old, (_, counted))) = tables.map.pop_lru() else {
                break;
            };
            if old == rel {
                // The table just opened is the most recently used: never the one dropped.
                tables.map.put(old, (slot.clone(), counted));
                break;
            }
            tables.bytes -= counted;
        }
        Ok(())
    }

    /// Tables kept parsed now and the bytes of metadata they hold (at most the budget, but
    /// for the most recently used table, which is kept whatever its size).
    pub fn tables_held(&self) -> (usize, usize) {
        self.tables
            .lock()
            .map(|t| (t.map.len(), t.bytes))
            .unwrap_or((0, 0))
    }

    fn folder(&self, idx: usize) -> Result<Arc<ImageFolder>, ViewError> {
        let mut map = self.folders.lock().map_err(|_| poisoned())?;
        if let Some(f) = map.get(&idx) {
            return Ok(f.clone());
        }
        let f = Arc::new(
            self.tree
                .image_folder(idx)
                .ok_or_else(|| ViewError::NotFound(PathBuf::new()))?,
        );
        map.insert(idx, f.clone());
        Ok(f)
    }

    /// Directory or file (with exact size) at `rel` under `.npy/`.
    pub fn stat(&self, rel: &Path) -> Result<ViewKind, ViewError> {
        let not_found = || ViewError::NotFound(rel.to_path_buf());
        match self.tree.lookup(rel).ok_or_else(not_found)? {
            Node::Dir(_) | Node::TableDir(..) => Ok(ViewKind::Dir),
            Node::ImageFile(idx, "images.npy") => {
                let dir = self.tree.dir_at(idx).ok_or_else(not_found)?;
                Ok(ViewKind::File(images_len(
                    dir.samples,
                    self.opts.image_size,
                )))
            }
            Node::ImageFile(..) | Node::TableFile(..) => Ok(ViewKind::File(self.open(rel)?.len())),
        }
    }

    /// Entries of the directory `rel` under `.npy/`, with exact file sizes. A corrupt table's
    /// directory fails with [`ViewError::Corrupt`], a too-wide one with
    /// [`ViewError::Unsupported`].
    pub fn read_dir(&self, rel: &Path) -> Result<Vec<ViewEntry>, ViewError> {
        let not_found = || ViewError::NotFound(rel.to_path_buf());
        match self.tree.lookup(rel).ok_or_else(not_found)? {
            Node::Dir(idx) => {
                let dir = self.tree.dir_at(idx).ok_or_else(not_found)?;
                let mut out = Vec::new();
                for (name, is_dir) in dir.entry_names() {
                    let kind = if is_dir {
                        ViewKind::Dir
                    } else {
                        self.stat(&rel.join(&name))?
                    };
                    out.push(ViewEntry { name, kind });
                }
                Ok(out)
            }
            Node::TableDir(src_rel, fmt) => Ok(self
                .table(&src_rel, fmt)?
                .entries()
                .into_iter()
                .map(|(name, len)| ViewEntry {
                    name: name.into(),
                    kind: ViewKind::File(len),
                })
                .collect()),
            Node::TableFile(..) | Node::ImageFile(..) => Err(not_found()),
        }
    }

    /// The view of the file `rel` under `.npy/` (cached for `images.npy`).
    pub fn open(&self, rel: &Path) -> Result<Arc<dyn View>, ViewError> {
        let not_found = || ViewError::NotFound(rel.to_path_buf());
        match self.tree.lookup(rel).ok_or_else(not_found)? {
            Node::Dir(_) | Node::TableDir(..) => Err(not_found()),
            Node::TableFile(src_rel, fmt, name) => {
                self.table(&src_rel, fmt)?.view(&name).ok_or_else(not_found)
            }
            Node::ImageFile(idx, "images.npy") => {
                let mut map = self.images.lock().map_err(|_| poisoned())?;
                if let Some(v) = map.get(&idx) {
                    return Ok(v.clone());
                }
                let v = Arc::new(ImagesView::new(
                    self.src.clone(),
                    self.folder(idx)?,
                    self.opts.clone(),
                ));
                map.insert(idx, v.clone());
                Ok(v)
            }
            Node::ImageFile(idx, name) => {
                let folder = self.folder(idx)?;
                Ok(Arc::new(
                    image_file_view(&folder, name).ok_or_else(not_found)?,
                ))
            }
        }
    }
}

fn poisoned() -> ViewError {
    ViewError::Io(std::io::Error::other(
        "a view lock was poisoned by an earlier panic",
    ))
}

/// The view of the file `rel` under `.npy/`, built afresh (no caching across calls).
pub fn open_view(
    src: Arc<dyn ByteSource>,
    tree: &ViewTree,
    rel: &Path,
    opts: &ViewOptions,
) -> Result<Arc<dyn View>, ViewError> {
    let not_found = || ViewError::NotFound(rel.to_path_buf());
    match tree.lookup(rel).ok_or_else(not_found)? {
        Node::Dir(_) | Node::TableDir(..) => Err(not_found()),
        Node::TableFile(src_rel, fmt, name) => Arc::new(Table::open(src, &src_rel, fmt)?)
            .view(&name)
            .ok_or_else(not_found),
        Node::ImageFile(idx, name) => {
            let folder = tree.image_folder(idx).ok_or_else(not_found)?;
            if name == "images.npy" {
                return Ok(Arc::new(ImagesView::new(
                    src,
                    Arc::new(folder),
                    opts.clone(),
                )));
            }
            Ok(Arc::new(
                image_file_view(&folder, name).ok_or_else(not_found)?,
            ))
        }
    }
}

/// Files (name, size) of the directory of the table at source path `rel`.
pub fn table_entries(
    src: Arc<dyn ByteSource>,
    rel: &Path,
) -> Result<Vec<(String, u64)>, ViewError> {
    let format = rel
        .file_name()
        .and_then(TableFormat::of)
        .ok_or_else(|| ViewError::NotFound(rel.to_path_buf()))?;
    Ok(Table::open(src, rel, format)?.entries())
}
