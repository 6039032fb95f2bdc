//! The stagefs filesystem core.
