//! What a store's own files take on disk, and what a reclaim run gave back
//! (`ActivationStore::reclaim_space`). Only a store that keeps its own file
//! (SQLite) answers these; PostgreSQL's space is the server's business.

/// The files of an embedded store, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FileSpace {
    /// The main database file's length on disk.
    pub file_bytes: u64,
    /// Its write-ahead log's length on disk (0 when there is none).
    pub wal_bytes: u64,
    /// Pages on the database's free list (`freelist_count * page_size`),
    /// part of the database's pages (of `file_bytes` once checkpointed):
    /// reused by new rows, or given back by a reclaim.
    pub free_bytes: u64,
}

/// One bounded reclaim run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpaceReclaim {
    /// The files when the run started.
    pub before: FileSpace,
    /// The files when it ended: what the gauges show.
    pub after: FileSpace,
    /// The run stopped at its bound, or could not finish its checkpoint
    /// (a reader held the WAL): another run soon gives more back.
    pub more: bool,
}
