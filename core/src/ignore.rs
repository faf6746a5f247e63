//! TODO: being written — `.dockerignore` with Docker's matching rules.
#[derive(Debug, thiserror::Error)]
#[error("stub")]
pub struct IgnoreError;
