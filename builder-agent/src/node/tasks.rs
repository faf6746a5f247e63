//! Node tasks (placeholder).
