//! The `.npy/` namespace: which view directories and files exist, computed from a listing of the
//! source tree alone (no file is read), so a mount can answer `readdir` and `stat` at once.
//!
//! A source directory appears under `.npy/` when it holds anything viewable below it: a table
//! file (`*.parquet`, `*.csv`) becomes a directory named after the file, and a directory with
//! JPEG/PNG images anywhere below gets the image-folder files ([`IMAGE_FILES`]). Image samples
//! follow torchvision's `ImageFolder`: subdirectories holding images are the classes (sorted by
//! name), each class's images come from `sorted(os.walk(class_dir))` with file names sorted
//! within a directory; a directory whose subdirectories hold no image has its own images as the
//! samples of class 0. Deviations, all in cases `ImageFolder` refuses or never sees: a
//! subdirectory without images is not a class (ImageFolder raises), symlinks are not followed,
//! only `.jpg`/`.jpeg`/`.png` (any case) count, and names containing a newline are skipped
//! and reported (they would break `files.txt`).
//!
//! A directory that cannot be listed (unreadable, a path too long) or lies deeper than
//! [`MAX_DEPTH`] is skipped and listed in [`ViewTree::skipped`]; the rest of the tree is
//! still viewable. Only an unreadable root fails the scan.
//!
//! Provenance: [`ViewTree::source_of`] says which source path each view path derives from
//! (the table file, or the image folder), so the mount can give a view its input's owner and
//! read bits.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::error::ViewError;
use crate::source::{ByteSource, EntryKind};

/// Deepest directory level scanned (the root is 0): deeper ones are skipped and reported. The
/// scan recurses once per level; 256 levels is far beyond any dataset and keeps the stack small.
pub const MAX_DEPTH: usize = 256;

/// Names of the files of an image folder view.
pub const IMAGE_FILES: [&str; 4] = ["images.npy", "labels.npy", "classes.txt", "files.txt"];

/// A table file format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TableFormat {
    /// Apache Parquet.
    Parquet,
    /// Comma-separated values with a header line.
    Csv,
}

impl TableFormat {
    /// The format of a file, from its extension (case-insensitive).
    pub fn of(name: &OsStr) -> Option<TableFormat> {
        let ext = Path::new(name).extension()?.to_str()?.to_ascii_lowercase();
        match ext.as_str() {
            "parquet" => Some(TableFormat::Parquet),
            "csv" => Some(TableFormat::Csv),
            _ => None,
        }
    }
}

fn is_image(name: &OsStr) -> bool {
    let Some(ext) = Path::new(name).extension().and_then(OsStr::to_str) else {
        return false;
    };
    matches!(ext.to_ascii_lowercase().as_str(), "jpg" | "jpeg" | "png")
}

/// One source directory, as far as views care.
#[derive(Clone, Debug, Default)]
pub struct ViewDir {
    /// Source path relative to the root (`""` for the root).
    pub rel: PathBuf,
    /// Viewable subdirectories (name, index into the tree), sorted by name.
    pub subdirs: Vec<(OsString, usize)>,
    /// Table files directly here, sorted by name; each is a directory under `.npy/`.
    pub tables: Vec<(OsString, TableFormat)>,
    /// Image files directly here, sorted by name.
    pub images: Vec<OsString>,
    /// Number of samples of this directory's image folder view (0: no image view here).
    pub samples: u64,
    /// Images anywhere below (including directly here).
    pub images_below: u64,
}

impl ViewDir {
    /// True when this directory has the image-folder files.
    pub fn has_images(&self) -> bool {
        self.samples > 0
    }

    /// Names of the entries of this directory under `.npy/`: subdirectories, table directories
    /// and, when it is an image folder, [`IMAGE_FILES`].
    pub fn entry_names(&self) -> Vec<(OsString, bool)> {
        let mut out: Vec<(OsString, bool)> = Vec::new();
        out.extend(self.subdirs.iter().map(|(n, _)| (n.clone(), true)));
        out.extend(self.tables.iter().map(|(n, _)| (n.clone(), true)));
        if self.has_images() {
            out.extend(IMAGE_FILES.iter().map(|n| (OsString::from(n), false)));
        }
        out
    }
}

/// What a path under `.npy/` names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Node {
    /// A directory mirroring a source directory (index into the tree).
    Dir(usize),
    /// A table's directory: source path of the table file and its format.
    TableDir(PathBuf, TableFormat),
    /// A file inside a table's directory (table source path, format, file name).
    TableFile(PathBuf, TableFormat, String),
    /// One of [`IMAGE_FILES`] of the image folder at the directory with this index.
    ImageFile(usize, &'static str),
}

/// The `.npy/` namespace computed from a scan of the source tree.
#[derive(Clone, Debug, Default)]
pub struct ViewTree {
    dirs: Vec<ViewDir>,
    by_rel: HashMap<PathBuf, usize>,
    skipped: Vec<(PathBuf, String)>,
}

impl ViewTree {
    /// Lists the source tree through `src` (reads no file contents). Fails only when the root
    /// itself cannot be listed.
    pub fn scan(src: &dyn ByteSource) -> Result<ViewTree, ViewError> {
        let mut tree = ViewTree::default();
        let root = src.list_dir(Path::new(""))?;
        tree.scan_dir(src, PathBuf::new(), root, 0);
        Ok(tree)
    }

    /// Source entries that were skipped (path relative to the root, why): directories that
    /// could not be listed or lie too deep, names containing a newline.
    pub fn skipped(&self) -> &[(PathBuf, String)] {
        &self.skipped
    }

    /// Scans `rel` (whose listing is `entries`) recursively; returns its index, or None when
    /// nothing viewable is below.
    fn scan_dir(
        &mut self,
        src: &dyn ByteSource,
        rel: PathBuf,
        mut entries: Vec<crate::source::SourceEntry>,
        depth: usize,
    ) -> Option<usize> {
        entries.sort_by(|a, b| a.name.as_bytes().cmp(b.name.as_bytes()));
        let mut dir = ViewDir {
            rel: rel.clone(),
            ..ViewDir::default()
        };
        let mut child_dirs = Vec::new();
        for e in entries {
            if e.name.as_bytes().contains(&b'\n') {
                if e.kind != EntryKind::Other {
                    self.skipped.push((
                        rel.join(&e.name),
                        "name contains a newline (it could not be listed in files.txt)".into(),
                    ));
                }
                continue;
            }
            match e.kind {
                EntryKind::Dir => child_dirs.push(e.name),
                EntryKind::File => {
                    if let Some(fmt) = TableFormat::of(&e.name) {
                        dir.tables.push((e.name, fmt));
                    } else if is_image(&e.name) {
                        dir.images.push(e.name);
                    }
                }
                EntryKind::Other => {}
            }
        }
        let mut class_samples = 0u64;
        for name in child_dirs {
            let child = rel.join(&name);
            if depth + 1 > MAX_DEPTH {
                self.skipped.push((
                    child,
                    format!("directory nested deeper than {MAX_DEPTH} levels"),
                ));
                continue;
            }
            let listing = match src.list_dir(&child) {
                Ok(l) => l,
                Err(e) => {
                    self.skipped
                        .push((child, format!("cannot list this directory: {e}")));
                    continue;
                }
            };
            if let Some(idx) = self.scan_dir(src, child, listing, depth + 1) {
                let below = self.dirs[idx].images_below;
                class_samples += below;
                dir.subdirs.push((name, idx));
            }
        }
        dir.images_below = class_samples + dir.images.len() as u64;
        dir.samples = if class_samples > 0 {
            class_samples
        } else {
            dir.images.len() as u64
        };
        let viewable = rel.as_os_str().is_empty()
            || !dir.subdirs.is_empty()
            || !dir.tables.is_empty()
            || dir.images_below > 0;
        if !viewable {
            return None;
        }
        let idx = self.dirs.len();
        self.by_rel.insert(rel, idx);
        self.dirs.push(dir);
        Some(idx)
    }

    /// The source path (relative to the root) that the view path `rel` under `.npy/` derives
    /// from: the table file for a table's directory and files, the directory itself for a
    /// directory and for an image folder's files. None when `rel` names no view.
    pub fn source_of(&self, rel: &Path) -> Option<PathBuf> {
        match self.lookup(rel)? {
            Node::Dir(i) | Node::ImageFile(i, _) => self.dirs.get(i).map(|d| d.rel.clone()),
            Node::TableDir(p, _) | Node::TableFile(p, _, _) => Some(p),
        }
    }

    /// The directory whose `.npy/` path is `rel` (`""` = the `.npy/` root).
    pub fn dir(&self, rel: &Path) -> Option<&ViewDir> {
        match self.lookup(rel)? {
            Node::Dir(i) => self.dirs.get(i),
            _ => None,
        }
    }

    /// The directory at an index from [`Node::Dir`] or [`ViewDir::subdirs`].
    pub fn dir_at(&self, idx: usize) -> Option<&ViewDir> {
        self.dirs.get(idx)
    }

    /// All viewable directories (the root first is not guaranteed; use [`Self::dir`]).
    pub fn dirs(&self) -> &[ViewDir] {
        &self.dirs
    }

    /// What the path `rel` under `.npy/` names, if anything. File names inside table
    /// directories are not checked here (that needs the table's schema).
    pub fn lookup(&self, rel: &Path) -> Option<Node> {
        let mut cur = *self.by_rel.get(Path::new(""))?;
        let comps: Vec<&OsStr> = rel
            .components()
            .filter_map(|c| match c {
                std::path::Component::Normal(n) => Some(Some(n)),
                std::path::Component::CurDir => None,
                _ => Some(None),
            })
            .collect::<Option<Vec<_>>>()?;
        let mut i = 0;
        while i < comps.len() {
            let name = comps[i];
            let dir = &self.dirs[cur];
            if let Some((_, idx)) = dir.subdirs.iter().find(|(n, _)| n == name) {
                cur = *idx;
                i += 1;
                continue;
            }
            if let Some((_, fmt)) = dir.tables.iter().find(|(n, _)| n == name) {
                let table = dir.rel.join(name);
                return match comps.len() - i {
                    1 => Some(Node::TableDir(table, *fmt)),
                    2 => Some(Node::TableFile(
                        table,
                        *fmt,
                        comps[i + 1].to_str()?.to_string(),
                    )),
                    _ => None,
                };
            }
            if i + 1 == comps.len() && dir.has_images() {
                if let Some(f) = IMAGE_FILES.iter().find(|f| OsStr::new(f) == name) {
                    return Some(Node::ImageFile(cur, f));
                }
            }
            return None;
        }
        Some(Node::Dir(cur))
    }

    /// The samples of the image folder at directory `idx`: class names, and for each sample its
    /// path relative to that directory and its label, in `ImageFolder` order.
    pub fn image_folder(&self, idx: usize) -> Option<ImageFolder> {
        let dir = self.dirs.get(idx)?;
        let mut folder = ImageFolder {
            rel: dir.rel.clone(),
            ..ImageFolder::default()
        };
        let classes: Vec<&(OsString, usize)> = dir
            .subdirs
            .iter()
            .filter(|(_, i)| self.dirs[*i].images_below > 0)
            .collect();
        if classes.is_empty() {
            let name = dir.rel.file_name().unwrap_or(OsStr::new("."));
            folder.classes.push(name.to_os_string());
            for img in &dir.images {
                folder.samples.push((PathBuf::from(img), 0));
            }
        } else {
            for (label, (name, ci)) in classes.into_iter().enumerate() {
                folder.classes.push(name.clone());
                // sorted(os.walk(class_dir)): every directory below, ordered by path string.
                let mut walk: Vec<(Vec<u8>, usize)> = Vec::new();
                self.collect_dirs(*ci, PathBuf::from(name), &mut walk);
                walk.sort_by(|a, b| a.0.cmp(&b.0));
                for (path, di) in walk {
                    let base = PathBuf::from(OsStr::from_bytes(&path));
                    for img in &self.dirs[di].images {
                        folder.samples.push((base.join(img), label as i64));
                    }
                }
            }
        }
        Some(folder)
    }

    fn collect_dirs(&self, idx: usize, path: PathBuf, out: &mut Vec<(Vec<u8>, usize)>) {
        out.push((path.as_os_str().as_bytes().to_vec(), idx));
        for (name, child) in &self.dirs[idx].subdirs {
            if self.dirs[*child].images_below > 0 {
                self.collect_dirs(*child, path.join(name), out);
            }
        }
    }
}

/// The samples of one image folder view.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImageFolder {
    /// Source path of the folder, relative to the dataset root.
    pub rel: PathBuf,
    /// Class names (exact bytes), label order.
    pub classes: Vec<OsString>,
    /// (path relative to the folder, label), sample order.
    pub samples: Vec<(PathBuf, i64)>,
}
