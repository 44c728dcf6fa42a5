//! The one-process rule of the embedded store: an exclusive lock on
//! `<database>.lock`, keyed on the file's canonical path, so a second broker
//! on the same file refuses to start instead of competing for the writer.

use std::path::{Path, PathBuf};

use crate::store::{StoreError, StoreResult};

/// The path every name of one database file shares: symlinks and `..` resolved. The file may
/// not exist yet, so its directory is resolved and the name joined back.
fn canonical_path(path: &Path) -> StoreResult<PathBuf> {
    let resolve = |p: &Path| {
        std::fs::canonicalize(p).map_err(|err| {
            StoreError::Config(format!("cannot resolve SQLite path {}: {err}", p.display()))
        })
    };
    if path.exists() {
        return resolve(path);
    }
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
    let name = path.file_name().ok_or_else(|| {
        StoreError::Config(format!("SQLite path {} names no file", path.display()))
    })?;
    Ok(resolve(parent.unwrap_or(Path::new(".")))?.join(name))
}

/// Locks `<file>.lock` beside the database, keyed on the file's canonical path, so a second
/// process reaching the same file by another name (a symlink, a relative path) is refused too.
pub(super) fn lock_for_this_process(path: &Path) -> StoreResult<std::fs::File> {
    let path = canonical_path(path)?;
    let path = path.as_path();
    let mut lock_path = path.as_os_str().to_owned();
    lock_path.push(".lock");
    let lock_path = PathBuf::from(lock_path);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|err| {
            StoreError::Config(format!(
                "cannot open lock file {}: {err}",
                lock_path.display()
            ))
        })?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(StoreError::Config(format!(
            "SQLite database {} is in use by another taskbroker process (it holds {}); \
             the embedded store serves one process, use PostgreSQL for several replicas",
            path.display(),
            lock_path.display()
        ))),
        Err(std::fs::TryLockError::Error(err)) => Err(StoreError::Config(format!(
            "cannot lock {}: {err}",
            lock_path.display()
        ))),
    }
}
