//! Retention: deleting the oldest sealed segments when every consumer group is past them, or
//! when the log is over its byte or age cap. The active segment is never deleted.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::clock::now_ns;
use crate::error::{Result, io_err};
use crate::state::LogState;

/// What may remove old records. All off by default: a log keeps everything.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Retention {
    /// Delete a sealed segment once every consumer group has acknowledged all its records
    /// (never when the log has no group).
    pub delete_consumed: bool,
    /// Keep at most this many bytes of segment files (the active segment always stays).
    pub max_bytes: Option<u64>,
    /// Delete a sealed segment once its newest record is older than this.
    pub max_age: Option<Duration>,
}

/// What one pass of retention removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RetentionReport {
    pub segments_removed: usize,
    pub bytes_removed: u64,
    pub records_removed: u64,
    /// Records removed that some group had not acknowledged (counted in that group's `skipped`).
    pub records_skipped: u64,
}

/// The offset every consumer group has acknowledged everything below; `None` without a group
/// whose position is known. (A group being opened stands at the log's first offset meanwhile,
/// `ConsumerGroup::open`, so it holds everything back; `u64::MAX`, a position not known, is
/// passed over.)
pub(crate) fn min_committed(groups: &std::collections::BTreeMap<String, Arc<crate::group::GroupEntry>>) -> Option<u64> {
    let committed = groups.values().map(|g| g.committed.load(Ordering::Acquire));
    committed.filter(|&c| c != u64::MAX).min()
}

/// Deletes what the policy allows, oldest segment first, stopping at the first segment that
/// must stay (so the log stays contiguous).
pub(crate) fn apply(shared: &LogState) -> Result<RetentionReport> {
    let policy = shared.options().retention;
    let mut report = RetentionReport::default();
    if policy == Retention::default() {
        return Ok(report);
    }
    let groups = shared.groups();
    let min_committed = min_committed(&groups);
    let mut segments = shared.segments_mut();
    let old_first = segments[0].base;
    let mut total: u64 = segments.iter().map(|s| s.map.len() as u64).sum();
    let now = now_ns();
    let mut removed = Vec::new();
    while segments.len() > 1 {
        let (seg, next_base) = (&segments[0], segments[1].base);
        let consumed = policy.delete_consumed && min_committed.is_some_and(|c| c >= next_base);
        let over_bytes = policy.max_bytes.is_some_and(|max| total > max);
        let too_old = policy.max_age.is_some_and(|age| {
            let newest = seg.timestamp_of(next_base - 1);
            // (An age past 2^64 ns, ~585 years, is never reached.)
            let age = u64::try_from(age.as_nanos()).unwrap_or(u64::MAX);
            newest.is_some_and(|ts| ts.saturating_add(age) < now)
        });
        if !(consumed || over_bytes || too_old) {
            break;
        }
        total -= seg.map.len() as u64;
        report.segments_removed += 1;
        report.bytes_removed += seg.map.len() as u64;
        report.records_removed += next_base - seg.base;
        removed.push(segments.remove(0));
    }
    if removed.is_empty() {
        return Ok(report);
    }
    shared.count_retention_removal();
    let first = segments[0].base;
    shared.set_first_offset(first);
    drop(segments);
    if let Some(keys) = shared.keys() {
        keys.forget_before(first);
    }
    for seg in &removed {
        shared.options().page_budget.forget(seg);
    }
    // Groups behind the new start lose records: count them, and move closed groups' cursors
    // (open ones move themselves on their next poll).
    for (name, entry) in groups.iter() {
        if entry.committed.load(Ordering::Acquire) >= first {
            continue;
        }
        // An open group's cursor moves only when it next polls (or, closed before that, when it
        // is opened again): count each record once. (From the window's start: what a group
        // acknowledged after a record it holds is not lost; a held record is counted when the
        // group steps over it.)
        let window_start = entry.window_start.load(Ordering::Acquire);
        let counted = window_start.max(old_first).max(entry.skipped_to.fetch_max(first, Ordering::AcqRel));
        let lost = first.saturating_sub(counted);
        entry.skipped.fetch_add(lost, Ordering::Relaxed);
        report.records_skipped += lost;
        if lost > 0 {
            tracing::warn!(group = %name, skipped = lost, "retention removed records the group had not read");
        }
        if !entry.open.load(Ordering::Acquire) {
            // Its acknowledgements of records still in the log stay. A cursor that cannot be
            // moved now is moved when the group is next opened (which does the same); the
            // segments go all the same.
            let path = crate::group::cursor_path(shared.dir(), name);
            // Synced whatever the log's durability: the group's own is not known here, and a
            // rename that reached the disk before the file's bytes (a power loss) would leave an
            // empty cursor, read as a group at the oldest record. Rare: only a cap does this.
            let moved = crate::group::read_cursor(&path).and_then(|state| {
                let held_lost = state.held.iter().filter(|&&o| o < first).count() as u64;
                entry.skipped.fetch_add(held_lost, Ordering::Relaxed);
                let state = state.within(first, u64::MAX);
                crate::group::create_cursor(shared.dir(), name, &state, true)?;
                Ok(state)
            });
            match moved {
                Ok(state) => entry.show(state.committed, state.acked_above.len(), &state.held),
                Err(e) => {
                    tracing::warn!(group = %name, error = %e, "could not move the group's cursor past removed records")
                }
            }
        }
    }
    drop(groups);
    for seg in removed {
        // Readers still holding the segment keep its mapping; the space returns when they let go.
        std::fs::remove_file(&seg.path).map_err(io_err("remove segment", &seg.path))?;
        let _ = crate::index::remove(shared.dir(), seg.base);
        drop(Arc::clone(&seg));
    }
    tracing::info!(
        segments = report.segments_removed,
        bytes = report.bytes_removed,
        records = report.records_removed,
        "retention removed old segments"
    );
    Ok(report)
}
