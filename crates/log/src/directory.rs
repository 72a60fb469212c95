//! A log's directory: the lock its writer holds, and the segment files in it.

use std::fs::{self, File};
use std::path::Path;

use crate::error::{Error, Result, io_err};
use crate::segment;

/// Base offsets of the segments in `dir`, oldest first, and how many leftover temporary files
/// (an interrupted segment creation) were found — and removed, if `remove_leftovers`.
pub(crate) fn list_segments(dir: &Path, remove_leftovers: bool) -> Result<(Vec<u64>, usize)> {
    let mut bases = Vec::new();
    let mut leftovers = 0;
    for entry in fs::read_dir(dir).map_err(io_err("list directory", dir))? {
        let entry = entry.map_err(io_err("list directory", dir))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if segment::is_leftover_tmp(&name) {
            if remove_leftovers {
                fs::remove_file(entry.path()).map_err(io_err("remove leftover", entry.path()))?;
            }
            leftovers += 1;
        } else if let Some(base) = segment::parse_name(&name) {
            bases.push(base);
        }
    }
    bases.sort_unstable();
    Ok((bases, leftovers))
}

/// Takes the log's writer lock: an exclusive flock(2) on the directory itself, so a log costs no
/// lock file (a server with thousands of queues creates thousands of logs).
pub(crate) fn lock_dir(dir: &Path) -> Result<File> {
    let file = File::open(dir).map_err(io_err("open directory to lock it", dir))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(Error::Locked { path: dir.to_path_buf() }),
        Err(std::fs::TryLockError::Error(e)) => Err(io_err("lock", dir)(e)),
    }
}
