//! Offline tools: a read-only view of a log, a full check of every frame, and the explicit
//! repair that truncates at the first bad frame.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::directory::{list_segments, lock_dir};
use crate::error::corrupt;
use crate::error::{Error, Reason, Result, io_err};
use crate::frame;
use crate::mmap::SEGMENT_HEADER_LEN;
use crate::options::Options;
use crate::reader::Reader;
use crate::recovery::{self, Stop};
use crate::recovery::{corrupt_before_valid, corrupt_undecided, scan_start};
use crate::segment::{self, Segment, SegmentHeader};
use crate::state::LogState;

/// Opens `dir` for reading only: no lock is taken and nothing is written, so it works beside a
/// running writer (which may append while this reads) and on a log that needs repair. A torn
/// tail is hidden, as the next open would cut it.
pub fn open_read_only(dir: impl AsRef<Path>) -> Result<Reader> {
    let dir = dir.as_ref();
    let (bases, _) = list_segments(dir, false)?;
    let Some((&last, sealed)) = bases.split_last() else {
        return Err(Error::NotALog { path: dir.to_path_buf(), reason: "no segment files".into() });
    };
    let mut segments = Vec::with_capacity(bases.len());
    for &base in sealed {
        let (seg, header) = Segment::open(&dir.join(segment::file_name(base)), base, false)?;
        if let Err(reason) = header {
            return Err(corrupt(&seg.path, 0, None, Reason::Other(reason)));
        }
        segments.push(Arc::new(seg));
    }
    let (seg, header) = Segment::open(&dir.join(segment::file_name(last)), last, false)?;
    let (start, start_offset) = scan_start(&seg, &header);
    let scan = recovery::scan_beside_writer(
        seg.format,
        || seg.map.published().from(SEGMENT_HEADER_LEN),
        start - SEGMENT_HEADER_LEN,
        start_offset,
    );
    match scan.stop {
        Stop::Corrupt { error, later_pos, later_offset } => {
            return Err(corrupt_before_valid(
                &seg,
                SEGMENT_HEADER_LEN + scan.end,
                scan.next_offset,
                error,
                later_pos,
                later_offset,
            ));
        }
        Stop::Undecided { error, searched_to } => {
            return Err(corrupt_undecided(&seg, SEGMENT_HEADER_LEN + scan.end, scan.next_offset, error, searched_to));
        }
        Stop::Clean | Stop::Torn { .. } => {}
    }
    let end = SEGMENT_HEADER_LEN + scan.end;
    let seg = seg.read_only_until(end, scan.next_offset - last)?;
    segments.push(Arc::new(seg));
    let options = Options { create: false, ..Options::default() };
    // (A group whose cursor is damaged is left out: its records can still be read.)
    let (cursors, _unreadable) = crate::group::load_readable(dir)?;
    Ok(Reader::new(LogState::new(dir.to_path_buf(), options, segments, scan.next_offset, cursors, None)))
}

/// Whether `dir` holds segment files: a log's records (an unreadable directory holds none).
pub fn holds_segments(dir: impl AsRef<Path>) -> bool {
    crate::directory::list_segments(dir.as_ref(), false).is_ok_and(|(bases, _)| !bases.is_empty())
}

/// The consumer groups of the log in `dir`, read from their cursor files (no lock taken).
pub fn list_groups(dir: impl AsRef<Path>) -> Result<Vec<crate::GroupInfo>> {
    let (groups, unreadable) = list_readable_groups(dir)?;
    match unreadable.into_iter().next() {
        Some((_, e)) => Err(e),
        None => Ok(groups),
    }
}

/// `list_groups`, with the groups whose cursor holds no valid slot apart (name and why).
pub fn list_readable_groups(dir: impl AsRef<Path>) -> Result<(Vec<crate::GroupInfo>, crate::group::Unreadable)> {
    let (groups, unreadable) = crate::group::load_readable(dir.as_ref())?;
    let groups = groups
        .into_iter()
        .map(|(name, state)| crate::GroupInfo {
            name,
            committed: state.lowest_unacknowledged(),
            acked_above: state.acked_above.len(),
            held: state.held.len(),
            window_start: state.committed,
            open: false,
            skipped: 0,
        })
        .collect();
    Ok((groups, unreadable))
}

/// One problem `verify` found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub file: PathBuf,
    /// Byte position in the file.
    pub position: u64,
    /// The record expected there.
    pub offset: Option<u64>,
    pub kind: ProblemKind,
    pub detail: String,
    /// Where valid records start again after a bad frame (`Corrupt` only, when one was found).
    pub resumes_at: Option<u64>,
    /// How many records the damage took, when that is known: a format-1 frame says its offset;
    /// a later one is one record when the bad frame's own length ends exactly where the first
    /// valid frame after it starts.
    pub records_lost: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProblemKind {
    /// A bad frame before the end, or missing records: data is damaged.
    Corrupt,
    /// An interrupted last append at the very end of the log; the next open cuts it.
    TornTail,
    /// A segment's header is damaged (its frames are checked all the same): `repair` writes it
    /// again from the file's name and its frames.
    Header,
    /// A consumer group's cursor file has no valid slot: the group's position is lost, and the
    /// log does not open. `repair` starts the group again at the oldest record on disk.
    Cursor,
}

impl Problem {
    /// Whether this is records missing before a segment (or a segment starting inside the one
    /// before): `repair` removes that segment and every later one.
    pub fn is_segment_gap(&self) -> bool {
        let base = self.file.file_name().and_then(|n| segment::parse_name(&n.to_string_lossy()));
        self.position == SEGMENT_HEADER_LEN as u64 && self.offset.is_some() && base.is_some() && base != self.offset
    }
}

/// What `verify` saw.
#[derive(Clone, Debug, Default)]
pub struct VerifyReport {
    pub segments: usize,
    /// Valid records checked.
    pub records: u64,
    /// Bytes of valid frames checked.
    pub frame_bytes: u64,
    pub first_offset: u64,
    pub next_offset: u64,
    pub problems: Vec<Problem>,
}

impl VerifyReport {
    pub fn is_clean(&self) -> bool {
        self.problems.iter().all(|p| p.kind == ProblemKind::TornTail)
    }
}

/// Checks every frame of every segment (magic, length, CRC, flags, offsets dense across
/// segments) and each cursor, and lists each problem. `progress(done, total)` is called with
/// segment bytes.
///
/// Beside a server writing the log, a record being written can look damaged for a moment (its
/// frame half there while the one after it is whole): the last segment is read as
/// `recovery::scan_beside_writer` reads it.
pub fn verify(dir: impl AsRef<Path>, mut progress: impl FnMut(u64, u64)) -> Result<VerifyReport> {
    let dir = dir.as_ref();
    let (bases, _) = list_segments(dir, false)?;
    if bases.is_empty() {
        return Err(Error::NotALog { path: dir.to_path_buf(), reason: "no segment files".into() });
    }
    let mut total = 0;
    for &base in &bases {
        let path = dir.join(segment::file_name(base));
        match fs::metadata(&path) {
            Ok(meta) => total += meta.len(),
            // Deleted by retention since the listing (a server at work): passed over below.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err("stat segment", &path)(e)),
        }
    }
    let mut report = VerifyReport { segments: bases.len(), first_offset: bases[0], ..VerifyReport::default() };
    let mut done = 0;
    let mut expected = bases[0];
    // After damage in a format-2 segment the offsets of the records after it are not known (its
    // frames do not carry them) until the next segment's base says them again.
    let mut offsets_unknown = false;
    for (i, &base) in bases.iter().enumerate() {
        let is_last = i + 1 == bases.len();
        let opened = Segment::open(&dir.join(segment::file_name(base)), base, false);
        let (seg, header) = match opened {
            // Listed, and gone since: retention, which deletes the oldest segments only (those
            // before it too, read already or not), and the next starts the log.
            Err(Error::Io { ref source, .. }) if source.kind() == std::io::ErrorKind::NotFound && !is_last => {
                expected = bases[i + 1];
                report.first_offset = expected;
                report.segments -= 1;
                continue;
            }
            opened => opened?,
        };
        let problem = |position: usize, offset: Option<u64>, kind, detail: String| Problem {
            file: seg.path.clone(),
            position: position as u64,
            offset,
            kind,
            detail,
            resumes_at: None,
            records_lost: None,
        };
        if let Err(reason) = &header {
            report.problems.push(problem(0, None, ProblemKind::Header, format!("segment header: {reason}")));
        }
        if base != expected && !offsets_unknown {
            let detail = if base > expected {
                format!("records {expected}..{base} are missing before this segment")
            } else {
                format!("segment starts at record {base}, but the previous one ends at {expected}")
            };
            report.problems.push(problem(SEGMENT_HEADER_LEN, Some(expected), ProblemKind::Corrupt, detail));
        }
        expected = base;
        offsets_unknown = false;
        let data = seg.map.published().from(SEGMENT_HEADER_LEN);
        let mut pos = 0;
        loop {
            let scan = match is_last {
                true => recovery::scan_beside_writer(
                    seg.format,
                    || seg.map.published().from(SEGMENT_HEADER_LEN),
                    pos,
                    expected,
                ),
                false => recovery::scan(seg.format, data, pos, expected),
            };
            let known = |offset: u64| (!offsets_unknown).then_some(offset);
            report.records += scan.records;
            report.frame_bytes += (scan.end - pos) as u64;
            expected = scan.next_offset;
            // Valid records that end before the durable checkpoint lost acknowledged ones: damage,
            // never a torn tail (a crash cannot take back what a sync wrote).
            let end = SEGMENT_HEADER_LEN + scan.end;
            let cut_below = header.as_ref().ok().filter(|h| h.checkpoint_pos > end as u64);
            let lost = cut_below.map(|h| recovery::below_checkpoint(end, expected, h));
            match scan.stop {
                Stop::Clean => {
                    if let Some(lost) = lost {
                        report.problems.push(problem(end, known(expected), ProblemKind::Corrupt, lost));
                    }
                    break;
                }
                Stop::Torn { error, .. } => {
                    let (kind, detail) = match (is_last, lost) {
                        (_, Some(lost)) => (ProblemKind::Corrupt, format!("{error}; {lost}")),
                        (true, None) => (
                            ProblemKind::TornTail,
                            format!(
                                "{error}: an interrupted last append (or, beside a running writer, one being \
                                 written), cut on the next open"
                            ),
                        ),
                        (false, None) => {
                            (ProblemKind::Corrupt, format!("{error}: the rest of this sealed segment is unreadable"))
                        }
                    };
                    report.problems.push(problem(end, known(expected), kind, detail));
                    break;
                }
                Stop::Undecided { error, searched_to } => {
                    let detail = format!(
                        "{error}; the search for valid records after it stopped at byte {}: the rest of this \
                         segment is not checked",
                        SEGMENT_HEADER_LEN + searched_to
                    );
                    report.problems.push(problem(
                        SEGMENT_HEADER_LEN + scan.end,
                        known(expected),
                        ProblemKind::Corrupt,
                        detail,
                    ));
                    offsets_unknown = true;
                    break;
                }
                Stop::Corrupt { error, later_pos, later_offset } => {
                    // A frame whose length still ends at the next valid frame was one record.
                    let one_frame = frame::peek_len(seg.format, &data[scan.end..]) == Some(later_pos - scan.end);
                    let later_offset = later_offset.or((one_frame && !offsets_unknown).then_some(expected + 1));
                    let lost = match later_offset {
                        Some(later) if later == expected + 1 => format!("record {expected} lost"),
                        Some(later) => format!("records {expected}..{later} lost"),
                        None => format!("records from {expected} on lost (how many is not known)"),
                    };
                    let detail = format!("{error}; {lost}, reading resumes at byte {}", SEGMENT_HEADER_LEN + later_pos);
                    report.problems.push(Problem {
                        resumes_at: Some((SEGMENT_HEADER_LEN + later_pos) as u64),
                        records_lost: later_offset.filter(|_| !offsets_unknown).map(|later| later - expected),
                        ..problem(SEGMENT_HEADER_LEN + scan.end, known(expected), ProblemKind::Corrupt, detail)
                    });
                    pos = later_pos;
                    match later_offset {
                        Some(later) => expected = later,
                        None => offsets_unknown = true,
                    }
                }
            }
        }
        done += seg.map.len() as u64;
        progress(done, total);
    }
    report.next_offset = expected;
    report.problems.extend(unreadable_cursors(dir)?);
    Ok(report)
}

/// The cursor files under `dir/groups` that have no valid slot (each names its group).
fn unreadable_cursors(dir: &Path) -> Result<Vec<Problem>> {
    let groups = dir.join(crate::group::GROUPS_DIR);
    let entries = match fs::read_dir(&groups) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err("list groups", &groups)(e)),
    };
    let mut out = Vec::new();
    for entry in entries {
        let path = entry.map_err(io_err("list groups", &groups))?.path();
        let is_cursor =
            path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.ends_with(crate::group::CURSOR_SUFFIX));
        // (One deleted meanwhile, a group removed beside a running server, is no problem; a
        // cursor that could not be read for another reason is not known to be damaged.)
        if !is_cursor {
            continue;
        }
        let unreadable = match crate::group::read_cursor(&path) {
            Ok(_) => false,
            Err(Error::Corrupt { .. }) => true,
            Err(Error::Io { ref source, .. }) if source.kind() == std::io::ErrorKind::NotFound => false,
            Err(e) => return Err(e),
        };
        if unreadable {
            let detail = "no valid cursor slot: the group's position is lost and the log does not open; \
                          repair starts the group again at the oldest record on disk (records after its lost \
                          position come again)";
            out.push(Problem {
                file: path,
                position: 0,
                offset: None,
                kind: ProblemKind::Cursor,
                detail: detail.into(),
                resumes_at: None,
                records_lost: None,
            });
        }
    }
    out.sort_by(|a, b| a.file.cmp(&b.file));
    Ok(out)
}

/// What `repair` did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RepairReport {
    /// Intact records removed: the valid ones after the first bad frame, to the end of the log.
    /// The records the bad frames held are not in it (how many is not always known: see
    /// `Problem::records_lost` in the report before the repair).
    pub records_removed: u64,
    pub segments_removed: usize,
    /// Where the log was cut, if it was.
    pub cut_at: Option<(PathBuf, u64)>,
    /// Segment headers rewritten from the file name (the frames were fine).
    pub headers_rewritten: usize,
    /// Groups whose unreadable cursor was written again at the oldest record on disk.
    pub groups_restarted: Vec<String>,
    /// Damaged records that every consumer group had passed, each written again under its
    /// offset as a record of zeros, so that the intact records after it stay.
    pub records_replaced: Vec<u64>,
    pub next_offset: u64,
}

/// Truncates the log at its first bad frame: that frame, everything after it in its segment and
/// every later segment are removed. A bad segment header over good frames is rewritten instead.
/// A bad frame that is one record (`Problem::records_lost`) every consumer group has passed (a
/// queue's consumed records, which nobody reads again) is replaced instead: the same bytes hold a
/// valid record of zeros under its offset, and the records after it stay.
/// Takes the directory lock, so the log must not be open for writing.
pub fn repair(dir: impl AsRef<Path>) -> Result<RepairReport> {
    repair_with(dir, Replace::Passed)
}

/// Which damaged records `repair_with` may write again as records of zeros.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replace {
    /// One that every consumer group has passed: for a log whose readers only move on (a
    /// queue's), which never read it again.
    Passed,
    /// None: for a log whose readers may seek back (a topic's groups), which would be handed a
    /// record of zeros as a message. The log is cut at its first bad frame instead.
    Never,
}

/// `repair`, replacing what `replace` says.
pub fn repair_with(dir: impl AsRef<Path>, replace: Replace) -> Result<RepairReport> {
    let dir = dir.as_ref();
    let _lock = lock_dir(dir)?;
    let before = verify(dir, |_, _| {})?;
    let mut out = RepairReport { next_offset: before.next_offset, ..RepairReport::default() };
    let (bases, _) = list_segments(dir, false)?;
    for problem in &before.problems {
        match problem.kind {
            ProblemKind::Header => {
                rewrite_header(&problem.file)?;
                out.headers_rewritten += 1;
            }
            ProblemKind::Cursor => {
                let file = problem.file.file_name().unwrap_or_default().to_string_lossy().into_owned();
                let name = file.strip_suffix(crate::group::CURSOR_SUFFIX).unwrap_or(&file).to_owned();
                let restart = crate::cursor::CursorState { committed: before.first_offset, ..Default::default() };
                crate::group::create_cursor(dir, &name, &restart, true)?;
                out.groups_restarted.push(name);
            }
            ProblemKind::Corrupt | ProblemKind::TornTail => {}
        }
    }
    let plan = plan_with(dir, &before, replace)?;
    for r in &plan.replace {
        use std::os::unix::fs::FileExt;
        let file = fs::OpenOptions::new().write(true).open(&r.file).map_err(io_err("open segment", &r.file))?;
        file.write_all_at(&r.frame, r.position).map_err(io_err("write segment", &r.file))?;
        file.sync_data().map_err(io_err("sync segment", &r.file))?;
        // Its index file (if sealed) is made again from the frames.
        let base = segment::parse_name(&r.file.file_name().unwrap_or_default().to_string_lossy())
            .expect("problems name segment files");
        crate::index::remove(dir, base);
        out.records_replaced.push(r.offset);
    }
    let Some(first) = &plan.cut else {
        if !out.records_replaced.is_empty() {
            segment::sync_dir(dir)?;
        }
        return Ok(out);
    };
    let cut_base = segment::parse_name(&first.file.file_name().unwrap_or_default().to_string_lossy())
        .expect("problems name segment files");
    let cut_offset = first.offset.expect("frame problems name the expected record");
    if first.is_segment_gap() {
        // Records missing before this segment (or it starts inside the one before): its records
        // cannot follow the ones before it, so it goes with every later one, and the segment
        // before ends the log. (Kept empty under its name, the gap stayed: no record could be
        // read past it, and the next append took the segment's base, not the log's end.)
        out.cut_at = Some((first.file.clone(), 0));
        out.segments_removed = remove_segments_from(dir, &bases, cut_base)?;
        let after = verify(dir, |_, _| {})?;
        out.records_removed = (before.records + out.records_replaced.len() as u64).saturating_sub(after.records);
        out.next_offset = after.next_offset;
        return Ok(out);
    }
    // In the order that leaves, wherever a crash stops it, a log a second repair finishes and
    // open never reads wrongly: the kept batch's end marked first (zeroing first would leave an
    // intact batch that continues into zeros, cut as a torn tail), the later segments removed
    // newest first (oldest first would leave a gap in the offsets), the cut zeroed last.
    end_batch_before(&first.file, first.position)?;
    crate::index::remove(dir, cut_base);
    out.cut_at = Some((first.file.clone(), first.position));
    out.segments_removed = remove_segments_from(dir, &bases, cut_base + 1)?;
    zero_from(&first.file, first.position)?;
    // Counted again rather than computed, so the number printed is what is really on disk.
    let after = verify(dir, |_, _| {})?;
    out.records_removed = (before.records + out.records_replaced.len() as u64).saturating_sub(after.records);
    out.next_offset = cut_offset;
    Ok(out)
}

/// Removes the segments of `bases` from base `from` on, newest first (oldest first would leave a
/// gap in the offsets, should a crash stop it), with their indexes; returns how many.
fn remove_segments_from(dir: &Path, bases: &[u64], from: u64) -> Result<usize> {
    let mut doomed: Vec<u64> = bases.iter().copied().filter(|&b| b >= from).collect();
    doomed.sort_unstable();
    for &base in doomed.iter().rev() {
        let path = dir.join(segment::file_name(base));
        fs::remove_file(&path).map_err(io_err("remove segment", &path))?;
        crate::index::remove(dir, base);
    }
    segment::sync_dir(dir)?;
    Ok(doomed.len())
}

/// What `repair` does with the damaged frames `verify` found (`report`): the records it
/// replaces with zeros, and where it cuts the log.
#[derive(Clone, Debug, Default)]
pub struct RepairPlan {
    pub replace: Vec<Replacement>,
    /// The first bad frame that is not replaced: the log is cut there.
    pub cut: Option<Problem>,
}

/// A damaged record every consumer group has passed, and the valid frame of zeros that takes
/// its place.
#[derive(Clone, Debug)]
pub struct Replacement {
    pub offset: u64,
    pub file: PathBuf,
    pub position: u64,
    frame: Vec<u8>,
}

/// What `repair` would do with the frame problems of `report` (`verify(dir)`'s), changing nothing.
pub fn plan(dir: &Path, report: &VerifyReport) -> Result<RepairPlan> {
    plan_with(dir, report, Replace::Passed)
}

/// What `repair_with` would do, changing nothing.
pub fn plan_with(dir: &Path, report: &VerifyReport, replace: Replace) -> Result<RepairPlan> {
    let may_replace = passed_by_every_group(dir);
    let passed = |offset: u64| replace == Replace::Passed && may_replace(offset);
    let mut plan = RepairPlan::default();
    for problem in report.problems.iter().filter(|p| matches!(p.kind, ProblemKind::Corrupt | ProblemKind::TornTail)) {
        let frame = match (problem.kind, problem.records_lost, problem.offset, problem.resumes_at) {
            (ProblemKind::Corrupt, Some(1), Some(offset), Some(resumes_at)) if passed(offset) => {
                zeros_frame(&problem.file, problem.position, resumes_at)?
            }
            _ => None,
        };
        match (frame, problem.offset) {
            (Some(frame), Some(offset)) => {
                plan.replace.push(Replacement { offset, file: problem.file.clone(), position: problem.position, frame })
            }
            _ => {
                plan.cut = Some(problem.clone());
                break;
            }
        }
    }
    Ok(plan)
}

/// Whether record `offset` is one that every consumer group of the log in `dir` has passed
/// (acknowledged, and not held back): false when the log has no group, or one is unreadable.
fn passed_by_every_group(dir: &Path) -> impl Fn(u64) -> bool {
    let cursors = crate::group::load_all(dir).ok().filter(|c| !c.is_empty());
    move |offset| {
        cursors
            .as_ref()
            .is_some_and(|all| all.values().all(|c| offset < c.committed && c.held.binary_search(&offset).is_err()))
    }
}

/// A valid record of zeros to write over the bad frame at `position` of segment `path`, filling
/// `[position, resumes_at)` exactly, so that the frames after it stay where they are. Its
/// timestamp is the bad frame's own if that lies between its neighbours', else the previous
/// frame's (a frame after it without one of its own takes it). `None` where that cannot be
/// done: a segment of format 1 or 2, a gap too short for a frame with a timestamp.
fn zeros_frame(path: &Path, position: u64, resumes_at: u64) -> Result<Option<Vec<u8>>> {
    let seg = open_segment_file(path)?;
    let gap = (resumes_at - position) as usize;
    let with_time = frame::FRAME_HEADER_LEN + frame::TIMESTAMP_LEN;
    // Formats 3, 4 and 5 have today's frames (a frame not of a batch is alike in all three);
    // earlier ones are only cut.
    // (A frame of 512 MiB or more, which formats 3 and 4 allowed, is more than today's can say.)
    let fits = (with_time..=frame::MAX_FRAME_LEN).contains(&gap);
    if !seg.format.inherits_time() || !fits || !gap.is_multiple_of(frame::FRAME_ALIGN) {
        return Ok(None);
    }
    let data = seg.map.published().from(SEGMENT_HEADER_LEN);
    let (at, resume) = (position as usize - SEGMENT_HEADER_LEN, resumes_at as usize - SEGMENT_HEADER_LEN);
    // The time in force before it: walk the frames from the segment's start.
    let (mut walked, mut before) = (0, 0);
    while walked < at {
        let Some(len) = frame::peek_len(seg.format, &data[walked..]) else { return Ok(None) };
        before = frame::own_timestamp(seg.format, &data[walked..]).unwrap_or(before);
        walked += len;
    }
    if walked != at {
        return Ok(None);
    }
    // The first time a frame after it holds of its own (the frames between take the new one's).
    let mut after = u64::MAX;
    let mut next = resume;
    while let Some(len) = frame::peek_len(seg.format, &data[next..]) {
        if let Some(t) = frame::own_timestamp(seg.format, &data[next..]) {
            after = t;
            break;
        }
        next += len;
    }
    // (A segment's first frame has none before it: the next one's, else the segment's birth.)
    let fallback = match at {
        0 if after != u64::MAX => after,
        0 => seg.header_or_stand_in().created,
        _ => before,
    };
    let time =
        frame::own_timestamp(seg.format, &data[at..]).filter(|t| (before..=after).contains(t)).unwrap_or(fallback);
    let zeros = vec![0u8; gap - with_time];
    let input = frame::Input::payload(&zeros);
    let mut bytes = vec![0u8; gap];
    // (It ends whatever batch it was of: the records before it stay, whole or not.)
    let written = frame::encode(&mut bytes, gap, Some(time), false, &input);
    assert_eq!(written, gap, "a frame of zeros fills the bad frame's place exactly");
    Ok(Some(bytes))
}

/// Writes the header a damaged one stands in for: the format judged by the frames, the base
/// from the file name, no checkpoint.
fn rewrite_header(path: &Path) -> Result<()> {
    use std::os::unix::fs::FileExt;
    let seg = open_segment_file(path)?;
    let header = seg.header_or_stand_in();
    drop(seg);
    let file = fs::OpenOptions::new().write(true).open(path).map_err(io_err("open segment", path))?;
    file.write_all_at(&header.encode(), 0).map_err(io_err("write segment header", path))?;
    file.sync_data().map_err(io_err("sync segment", path))
}

/// The segment file `path` opened read-only as its name says (its header as it may be).
fn open_segment_file(path: &Path) -> Result<Segment> {
    let base = segment::parse_name(&path.file_name().unwrap_or_default().to_string_lossy())
        .ok_or_else(|| Error::Config(format!("{} is not a segment file", path.display())))?;
    Ok(Segment::open(path, base, false)?.0)
}

/// Makes the frame before `position` (where `repair` cut the log) the last of its batch if it
/// said more of its batch followed: the records kept before the cut are whole, and the next open
/// would otherwise take them for a batch a crash interrupted and cut them too.
fn end_batch_before(path: &Path, position: u64) -> Result<()> {
    use std::os::unix::fs::FileExt;
    let seg = open_segment_file(path)?;
    let data = seg.map.published().from(SEGMENT_HEADER_LEN);
    let at = position as usize - SEGMENT_HEADER_LEN;
    // The frames before the cut are valid (the cut is at the first bad one): walk them.
    let (mut walked, mut last) = (0, None);
    while walked < at {
        let Some(len) = frame::peek_len(seg.format, &data[walked..]) else { return Ok(()) };
        last = Some(walked);
        walked += len;
    }
    let Some(last) = last.filter(|_| walked == at) else { return Ok(()) };
    let Some(first_bytes) = frame::ending_batch(seg.format, &data[last..]) else { return Ok(()) };
    let file = fs::OpenOptions::new().write(true).open(path).map_err(io_err("open segment", path))?;
    file.write_all_at(&first_bytes, (SEGMENT_HEADER_LEN + last) as u64).map_err(io_err("write segment", path))?;
    file.sync_data().map_err(io_err("sync segment", path))
}

/// Zeroes `path` from `position` to its end (keeping the space allocated) and resets its
/// checkpoint so the next open scans it from the start.
fn zero_from(path: &Path, position: u64) -> Result<()> {
    use std::os::unix::fs::FileExt;
    let file = fs::OpenOptions::new().read(true).write(true).open(path).map_err(io_err("open segment", path))?;
    let len = file.metadata().map_err(io_err("stat segment", path))?.len();
    if position < len {
        let zeroed = rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::ZERO_RANGE, position, len - position);
        if zeroed.is_err() {
            let zeros = vec![0u8; 1 << 20];
            let mut at = position;
            while at < len {
                let n = (len - at).min(zeros.len() as u64) as usize;
                file.write_all_at(&zeros[..n], at).map_err(io_err("zero segment", path))?;
                at += n as u64;
            }
        }
    }
    let mut raw = [0u8; SEGMENT_HEADER_LEN];
    file.read_exact_at(&mut raw, 0).map_err(io_err("read segment header", path))?;
    if let Ok(mut header) = SegmentHeader::decode(&raw) {
        header.checkpoint_pos = 0;
        header.checkpoint_offset = header.base_offset;
        file.write_all_at(&header.encode(), 0).map_err(io_err("write segment header", path))?;
    }
    file.sync_data().map_err(io_err("sync segment", path))
}
