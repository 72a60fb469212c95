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

/// Sets the format version in the header of `segment` and seals it with a valid CRC: a segment
/// as a build that writes that version would leave it.
#[allow(dead_code)] // not every test file uses it
pub fn set_format_version(segment: &Path, version: u32) {
    let mut bytes = fs::read(segment).unwrap();
    bytes[8..12].copy_from_slice(&version.to_le_bytes());
    let crc = crc32c::crc32c(&bytes[0..60]);
    bytes[60..64].copy_from_slice(&crc.to_le_bytes());
    fs::write(segment, bytes).unwrap();
}
