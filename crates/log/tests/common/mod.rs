//! Helpers shared by the log's integration tests.

use std::fs;
use std::path::{Path, PathBuf};

use petrel_log::OwnedRecord;

/// Every record from where `reader` stands to the log's end.
pub fn read_all(reader: &mut petrel_log::Reader) -> Vec<OwnedRecord> {
    let mut out = Vec::new();
    loop {
        let batch = reader.read_batch(64).unwrap();
        if batch.is_empty() {
            return out;
        }
        out.extend(batch.into_iter().map(|r| r.to_owned()));
    }
}

/// The segment files of the log in `dir`, oldest first.
pub fn segments(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .collect();
    v.sort();
    v
}
