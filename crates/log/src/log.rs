//! The writer side of a log: opening and recovering it, appending, and rolling segments.
//! What the writer shares with readers and groups is in `state.rs`; durability in `commit.rs`;
//! recovery in `recovery.rs`.

use std::fs;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::clock::{Clock, now_ns};
use crate::directory::{list_segments, lock_dir};
use crate::error::{Error, Reason, Result, corrupt, io_err};
use crate::frame::{self, Input};
use crate::mmap::{DataWriter, SEGMENT_HEADER_LEN};
use crate::options::{Durability, Options};
use crate::prefault::{self, Prefaulter};
use crate::reader::Reader;
use crate::recovery::{Recovered, RecoveryReport, recover_active};
use crate::resident::Use;
use crate::segment::{self, Segment};
use crate::state::{LogState, LogStats};
use crate::syncer::{self, Registration};

/// Where a record's time comes from.
#[derive(Clone, Copy)]
enum Stamp {
    /// The caller's (`Input::timestamp`): stored as it is (raised only to keep times in order).
    Given(u64),
    /// The log's clock.
    Clock(u64),
}

/// How far the clock must move past the time the last frames take before a record takes a
/// time of its own (and its frame 8 bytes more): a busy writer then writes a timestamp a few
/// times a millisecond instead of every few records (a 32-byte record takes 40 bytes, not 40.5).
/// So a record appended without a time of its own is stamped up to this much early, besides
/// the clock's own lag (`Clock`).
pub(crate) const CLOCK_RESOLUTION_NS: u64 = 100_000;

/// An open log with its single writer. Appends need `&mut self` and take no lock; for many
/// producer threads, convert it with [`Log::into_shared`].
pub struct Log {
    shared: Arc<LogState>,
    active: Arc<Segment>,
    writer: DataWriter,
    /// Where the next frame goes (ahead of the published end during a batch).
    pos: usize,
    next_offset: u64,
    last_timestamp: u64,
    /// The time the frames since the last that holds one take (`None`: the next frame must hold
    /// its own, as a segment's first does).
    frame_time: Option<u64>,
    /// The last frame written says the next is of its batch: a batch is being written.
    continued: bool,
    clock: Clock,
    /// The next frame starting at or after this position gets an index entry.
    next_index_pos: usize,
    /// The active segment's dense position index, filled as records are written.
    positions: Arc<crate::index::DenseIndex>,
    /// When the writer passes this position, it asks for the pages ahead to be faulted in.
    prefault_trigger: usize,
    prefaulter: Prefaulter,
    report: RecoveryReport,
    /// The background sync, under `Durability::Interval`.
    interval_sync: Option<Registration>,
    /// Held (flock) for as long as the writer, or a consumer group opened from it, lives
    /// (`LogState::lock`), unless `Options::lock_directory` is off.
    _lock: Option<Arc<std::fs::File>>,
}

impl Log {
    /// Opens the log in `dir`, creating it if allowed, and recovers it.
    pub fn open(dir: impl AsRef<Path>, options: Options) -> Result<Log> {
        Self::open_in(dir.as_ref(), options, false)
    }

    /// Makes a new log in `dir`, a directory its caller made just now for it (other files may be
    /// in it; no log is): nothing is listed or recovered, which saves a server the system calls
    /// of both for each queue made by first use. A segment already there is an error, never
    /// written over.
    pub fn open_made(dir: impl AsRef<Path>, options: Options) -> Result<Log> {
        Self::open_in(dir.as_ref(), options, true)
    }

    fn open_in(dir: &Path, options: Options, made_dir: bool) -> Result<Log> {
        options.validate()?;
        let dir = dir.to_path_buf();
        if options.create && !made_dir {
            fs::create_dir_all(&dir).map_err(io_err("create directory", &dir))?;
        }
        let lock = if options.lock_directory { Some(Arc::new(lock_dir(&dir)?)) } else { None };
        let mut report = RecoveryReport::default();
        let (bases, leftovers) = match made_dir {
            true => (Vec::new(), 0),
            false => list_segments(&dir, true)?,
        };
        report.leftovers_removed = leftovers;
        if bases.is_empty() && !options.create {
            // Told not to create a log: a directory without one is refused, not made one.
            return Err(Error::NotALog { path: dir, reason: "no segment files".into() });
        }
        let durable = options.durability != Durability::None;
        let now = now_ns();
        let mut segments = Vec::with_capacity(bases.len() + 1);
        let made = bases.is_empty();
        let mut active = if let Some((&last, sealed)) = bases.split_last() {
            for &base in sealed {
                let (seg, header) = Segment::open(&dir.join(segment::file_name(base)), base, false)?;
                if let Err(reason) = header {
                    return Err(corrupt(&seg.path, 0, None, Reason::Other(reason)));
                }
                segments.push(Arc::new(seg));
            }
            // Its header is checked by recovery, which can do without it.
            Segment::open(&dir.join(segment::file_name(last)), last, true)?.0
        } else {
            let place = if made_dir { segment::Place::New } else { segment::Place::Any };
            let first = Segment::create(&dir, 0, options.first_segment_bytes(), now, durable, place)?;
            if durable {
                segment::sync_dir(&dir)?;
            }
            first
        };
        let mut writer = active.map.writer().expect("a new mapping has its writer");
        let recovered = match made {
            // Made just now, empty: nothing to recover. (Reading it would fault in pages, and
            // the kernel's read-ahead more, that a log never written to does not need: a server
            // makes one for each queue named once.)
            true => Recovered { end: SEGMENT_HEADER_LEN, next_offset: active.base, end_page_on_disk: false },
            false => recover_active(&active, &mut writer, &mut report)?,
        };
        let (pos, next_offset) = (recovered.end, recovered.next_offset);
        if active.format != frame::Format::CURRENT && pos == SEGMENT_HEADER_LEN {
            // An empty last segment of an earlier format holds nothing to keep: it takes the
            // current format in place, as a new segment under its name could not.
            active.adopt_current_format(durable).map_err(io_err("sync segment", &active.path))?;
        }
        if !made {
            // Past the last frame every byte is zero (format.md): a crash can leave frames there
            // (appends after a page the disk lost, or blocks a prefault wrote), which appends
            // would write between and a later open read as records. Their blocks go, as a
            // closed log's do; the writer reserves what it needs again.
            active.release_unwritten(pos);
        }
        let active = Arc::new(active);
        segments.push(Arc::clone(&active));
        report.segments = segments.len();
        writer.publish(pos);
        active.set_tail(pos, next_offset - active.base);
        // What the records take is on disk; the writer reserves the rest as it goes. The page
        // it writes next is asked for only when recovery did not see it on disk already (asking
        // costs system calls, and a change of the file's times, for each log a server opens).
        match recovered.end_page_on_disk {
            true => active.map.set_allocated(pos.next_multiple_of(segment::PAGE).min(active.map.len())),
            false => active.allocate(pos)?,
        }
        // An index file of the active segment is left from a time it was sealed, before a crash
        // cut it back: it describes frames the writer will write over, and if the file of its
        // next seal were lost with a power loss, a later open would read the old one. Removed,
        // durably (the writer keeps its index in memory until the seal).
        if crate::index::remove(&dir, active.base) {
            crate::segment::sync_dir(&dir.join(crate::index::INDEX_DIR))?;
        }
        let walk = crate::index::build(active.format, active.map.published().from(SEGMENT_HEADER_LEN), active.base);
        // Recovery checked the frames from the durable checkpoint on; the walk covers those before
        // it, and must end where recovery did. A segment cut short and extended again reads as
        // zeros up to its checkpoint, which recovery does not read.
        let walked_to = SEGMENT_HEADER_LEN + walk.end;
        if (walked_to, walk.next_offset) != (pos, next_offset) {
            return Err(match active.header() {
                Ok(h) if h.checkpoint_pos > walked_to as u64 => {
                    crate::recovery::cut_below_checkpoint(&active, walked_to, walk.next_offset, &h)
                }
                _ => corrupt(
                    &active.path,
                    walked_to as u64,
                    Some(walk.next_offset),
                    Reason::Other(format!(
                        "the frames end here, yet recovery found them valid up to byte {pos} (record {next_offset})"
                    )),
                ),
            });
        }
        active.index.set(walk.entries);
        let positions = active.positions();

        let mut cursors = match made_dir {
            true => Default::default(),
            false => crate::group::load_all(&dir)?,
        };
        for (name, state) in cursors.iter_mut() {
            // The log was cut back (`petrel log repair`, or a crash that lost a tail the cursor
            // had seen) past where this group stood or what it acknowledged: records appended
            // from now on reuse those offsets and must reach the group.
            let within = state.clone().within(0, next_offset);
            if within != *state {
                tracing::warn!(group = %name, committed = state.committed, end = next_offset, "group moved back to the end of the log");
                *state = within;
                crate::group::create_cursor(&dir, name, state, durable)?;
            }
        }
        let shared = LogState::new(dir, options, segments, next_offset, cursors, lock.as_ref());
        // Whatever recovery kept was written before the crash; make it durable now if the
        // policy asks for durability, so the checkpoint covers it.
        if durable && next_offset > 0 {
            shared.make_durable(next_offset - 1)?;
        }
        let interval_sync = match shared.options().durability {
            Durability::Interval(every) => {
                let weak: std::sync::Weak<dyn syncer::IntervalSync> =
                    Arc::downgrade(&shared) as std::sync::Weak<LogState>;
                Some(syncer::register(weak, every)?)
            }
            _ => None,
        };
        let next_index_pos = index_resume_pos(&active);
        shared.options().page_budget.touch(&active, Use::Active);
        let mut log = Log {
            shared,
            active,
            writer,
            pos,
            next_offset,
            last_timestamp: 0,
            frame_time: None,
            continued: false,
            clock: Clock::default(),
            prefault_trigger: pos + prefault::STEP,
            next_index_pos,
            positions,
            prefaulter: Prefaulter::default(),
            report,
            interval_sync,
            _lock: lock,
        };
        // Timestamps never go back, across a reopen too (the time index relies on it).
        if let Some(last) = next_offset.checked_sub(1) {
            log.last_timestamp = log.reader().get(last)?.map_or(0, |r| r.timestamp);
        }
        if log.active.format != frame::Format::CURRENT {
            // A last segment of an earlier format with records in it is sealed as it is:
            // appends go on in a new segment of the current format.
            log.roll_to(0, NextSize::Grown)?;
        }
        Ok(log)
    }

    pub fn dir(&self) -> &Path {
        self.shared.dir()
    }

    pub fn options(&self) -> &Options {
        self.shared.options()
    }

    pub fn recovery_report(&self) -> &RecoveryReport {
        &self.report
    }

    /// Counters since open.
    pub fn stats(&self) -> LogStats {
        self.shared.stats()
    }

    /// Offset the next appended record will get.
    pub fn next_offset(&self) -> u64 {
        self.next_offset
    }

    /// Offset of the oldest record still in the log.
    pub fn first_offset(&self) -> u64 {
        self.shared.first_offset()
    }

    /// A reader positioned at the oldest record. Readers may live on other threads.
    pub fn reader(&self) -> Reader {
        Reader::new(Arc::clone(&self.shared))
    }

    /// Appends one record with just a payload; returns its offset.
    #[inline]
    pub fn append(&mut self, payload: &[u8]) -> Result<u64> {
        self.append_with(&Input::payload(payload))
    }

    /// Appends one record with optional key, headers and timestamp; returns its offset.
    pub fn append_with(&mut self, input: &Input<'_>) -> Result<u64> {
        let offset = self.append_unsynced(input)?;
        self.after_publish(offset)?;
        Ok(offset)
    }

    /// Appends payloads as consecutive records with one publication and (under `Always`) one
    /// sync; returns their offsets. Every payload is checked against the limits before any is
    /// written, so a batch that fails on a limit appends nothing.
    ///
    /// Readers see the whole batch at once, and a full disk fails it whole: a batch that does
    /// not fit the active segment's room starts a new segment, and its disk blocks are reserved
    /// before any of it is written. The one exception is a batch larger than a segment: it is
    /// published up to each segment boundary it crosses, and a full disk leaves those parts.
    ///
    /// A crash keeps a batch whole or cuts it whole: its frames say they are one batch, and
    /// recovery cuts a batch whose last frame is missing or torn. (A batch larger than a segment
    /// is not marked: a crash keeps its complete frames, as it may any unacknowledged append.)
    pub fn append_batch<P: AsRef<[u8]>>(&mut self, payloads: &[P]) -> Result<Range<u64>> {
        self.batch(payloads.len(), |i| Input::payload(payloads[i].as_ref()))
    }

    /// `append_batch` for records with keys, headers or timestamps.
    pub fn append_batch_with(&mut self, inputs: &[Input<'_>]) -> Result<Range<u64>> {
        self.batch(inputs.len(), |i| inputs[i])
    }

    /// Makes every appended record durable now, whatever the policy.
    pub fn sync(&mut self) -> Result<()> {
        self.shared.check_poison()?;
        match self.next_offset.checked_sub(1) {
            Some(last) => self.shared.make_durable(last),
            None => Ok(()),
        }
    }

    /// Opens (creating if needed) the consumer group `name`.
    pub fn group(&self, name: &str, options: crate::GroupOptions) -> Result<crate::ConsumerGroup> {
        crate::ConsumerGroup::open(Arc::clone(&self.shared), name, options)
    }

    /// Deletes old segments as `Options::retention` allows. Also done at every segment roll;
    /// call it to apply an age cap to a log that is not being written.
    pub fn apply_retention(&self) -> Result<crate::RetentionReport> {
        crate::retention::apply(&self.shared)
    }

    /// Applies retention to the active segment too, which `apply_retention` never deletes: when
    /// every record in it may go, it is sealed (the next starts at the log's first size) and
    /// retention deletes it with the others it allows. Its records may go when every consumer
    /// group has acknowledged them (`delete_consumed`: a drained queue; only a segment grown past
    /// the first size is worth a new one), or when the newest is older than `max_age` (a topic
    /// no longer published to). Without it, a drained log kept its active segment, up to
    /// `segment_bytes`, and an idle one records past their age, until appends filled the
    /// segment.
    pub fn give_back(&mut self) -> Result<crate::RetentionReport> {
        if self.shared.commit().is_poisoned() {
            // It takes no more appends (its error is reported where they fail): left as it is.
            return Ok(crate::RetentionReport::default());
        }
        let opts = self.shared.options();
        let policy = opts.retention;
        debug_assert!(!self.continued, "appends end their batches before they return");
        // The sealed segments go first: on a full disk, their space is what the new segment
        // takes.
        let mut report = crate::retention::apply(&self.shared)?;
        let holds_records = self.next_offset > self.active.base;
        let drained = policy.delete_consumed
            && crate::retention::min_committed(&self.shared.groups()).is_some_and(|c| c >= self.next_offset)
            && self.active.map.len() as u64 > opts.first_segment_bytes();
        let aged = policy.max_age.is_some_and(|age| {
            self.last_timestamp.saturating_add(u64::try_from(age.as_nanos()).unwrap_or(u64::MAX)) < now_ns()
        });
        if holds_records && (drained || aged) {
            self.roll_to(0, NextSize::First)?;
            let sealed = crate::retention::apply(&self.shared)?;
            report.segments_removed += sealed.segments_removed;
            report.bytes_removed += sealed.bytes_removed;
            report.records_removed += sealed.records_removed;
            report.records_skipped += sealed.records_skipped;
        }
        Ok(report)
    }

    /// Every consumer group of the log.
    pub fn groups(&self) -> Vec<crate::GroupInfo> {
        crate::group::infos(&self.shared)
    }

    /// Creates group `to` at the same position as group `from`.
    pub fn copy_group(&self, from: &str, to: &str) -> Result<()> {
        crate::group::copy(&self.shared, from, to)
    }

    /// Deletes a group (not while it is open).
    pub fn delete_group(&self, name: &str) -> Result<()> {
        crate::group::delete(&self.shared, name)
    }

    /// Turns this writer into a handle that many threads can clone and append through.
    pub fn into_shared(self) -> crate::SharedLog {
        crate::SharedLog::new(self)
    }

    /// Syncs (unless the policy is `None`) and closes the log, reporting a failed final sync.
    pub fn close(mut self) -> Result<()> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<()> {
        self.interval_sync.take();
        if self.shared.options().durability != Durability::None {
            self.sync()?;
        }
        // A closed log takes the disk its records take.
        self.release_past_end();
        Ok(())
    }

    pub(crate) fn shared(&self) -> &Arc<LogState> {
        &self.shared
    }

    /// Waits for durability as the policy says. Used after the record is published.
    pub(crate) fn after_publish(&self, last: u64) -> Result<()> {
        if self.shared.options().durability == Durability::Always {
            self.shared.make_durable(last)?;
        }
        Ok(())
    }

    /// Appends and publishes one record without waiting for durability.
    #[inline]
    pub(crate) fn append_unsynced(&mut self, input: &Input<'_>) -> Result<u64> {
        self.shared.check_poison()?;
        let len = self.check(input)?;
        let stamp = match input.timestamp {
            Some(t) => Stamp::Given(t),
            None => {
                let group_start = (self.next_offset - self.active.base).is_multiple_of(crate::index::TIME_GROUP as u64);
                Stamp::Clock(self.clock.now(group_start))
            }
        };
        let timestamp = self.timestamp(stamp);
        let offset = self.write(input, len, timestamp, false)?;
        self.publish();
        if let (Some(keys), Some(key)) = (self.shared.keys(), input.key) {
            keys.point([(key, offset)]);
        }
        Ok(offset)
    }

    pub(crate) fn batch<'a>(&mut self, n: usize, input: impl Fn(usize) -> Input<'a>) -> Result<Range<u64>> {
        let range = self.batch_unsynced(n, input)?;
        if !range.is_empty() {
            self.after_publish(range.end - 1)?;
        }
        Ok(range)
    }

    pub(crate) fn batch_unsynced<'a>(&mut self, n: usize, input: impl Fn(usize) -> Input<'a>) -> Result<Range<u64>> {
        self.shared.check_poison()?;
        let mut bytes = 0;
        for i in 0..n {
            bytes += frame::align_up(self.check(&input(i))?);
        }
        // A batch that fits in one segment is marked as one (each frame but the last says the
        // next is of its batch), so that recovery keeps it whole or cuts it whole.
        let one_segment = self.make_room(bytes)?;
        let first = self.next_offset;
        // The clock is read once per batch, and only for records that bring no time of their
        // own (a record's own time is not raised to the clock's).
        let mut clock = None;
        for i in 0..n {
            let input = input(i);
            let stamp = match input.timestamp {
                Some(t) => Stamp::Given(t),
                None => Stamp::Clock(*clock.get_or_insert_with(|| self.clock.now(false))),
            };
            let timestamp = self.timestamp(stamp);
            let continues = one_segment && i + 1 < n;
            if let Err(e) = self.write(&input, frame::frame_len(&input), timestamp, continues) {
                self.discard_unpublished();
                return Err(e);
            }
        }
        self.publish();
        if let Some(keys) = self.shared.keys() {
            keys.point((0..n).filter_map(|i| input(i).key.map(|key| (key, first + i as u64))));
        }
        Ok(first..self.next_offset)
    }

    /// Checks a record against the limits; returns its frame length.
    #[inline]
    fn check(&self, input: &Input<'_>) -> Result<usize> {
        let len = frame::frame_len(input);
        let record = frame::record_len(input);
        if record > self.shared.options().max_record_bytes {
            return Err(Error::RecordTooLarge { size: record, max: self.shared.options().max_record_bytes });
        }
        frame::check_input(input).map_err(Error::InvalidRecord)?;
        Ok(len)
    }

    /// A record's timestamp: `stamp`, raised to the previous record's if earlier. A clock
    /// reading less than `CLOCK_RESOLUTION_NS` past the time the last frames take is taken as
    /// that time, so that its frame leaves the timestamp out; a caller's time is kept exactly.
    #[inline]
    fn timestamp(&mut self, stamp: Stamp) -> u64 {
        let t = match stamp {
            Stamp::Given(t) => t.max(self.last_timestamp),
            Stamp::Clock(t) => {
                let t = t.max(self.last_timestamp);
                match self.frame_time {
                    // (Raised: a record whose write failed may have moved the last time past it.)
                    Some(held) if t.saturating_sub(held) < CLOCK_RESOLUTION_NS => held.max(self.last_timestamp),
                    _ => t,
                }
            }
        };
        self.last_timestamp = t;
        t
    }

    /// Writes one frame after the current position, rolling to a new segment if it does not
    /// fit. Not visible to readers until `publish`. `len` is `frame::frame_len(input)`;
    /// `continues`: the next frame is of the same batch.
    #[inline]
    fn write(&mut self, input: &Input<'_>, len: usize, timestamp: u64, continues: bool) -> Result<u64> {
        let aligned = frame::align_up(len);
        if self.pos + aligned > self.active.map.len() {
            // A batch marked as one was given room in one segment (`make_room`): a segment never
            // ends on a frame that says more of its batch follows.
            assert!(!self.continued, "a marked batch does not cross segments");
            self.roll_to(aligned, NextSize::Grown)?;
        }
        if self.pos + aligned > self.active.map.allocated() {
            self.allocate(self.pos + aligned)?;
        }
        if self.active.lru_stamp.load(Ordering::Relaxed) == 0 {
            // The page budget took this segment's pages back: it counts again before this
            // write faults one in.
            self.shared.options().page_budget.touch(&self.active, Use::Active);
        }
        // A frame leaves its timestamp out when it is the previous frame's; a segment's first
        // holds one.
        let (len, own_time) = match self.frame_time == Some(timestamp) {
            true => (len - frame::TIMESTAMP_LEN, None),
            false => {
                self.frame_time = Some(timestamp);
                (len, Some(timestamp))
            }
        };
        let start = self.writer.published_end();
        let buf = &mut self.writer.unpublished_mut()[self.pos - start..];
        let offset = self.next_offset;
        let aligned = frame::encode(buf, len, own_time, continues, input);
        self.continued = continues;
        let holds_time = own_time.is_some() || !self.active.format.inherits_time();
        self.positions.set((offset - self.active.base) as usize, self.pos, holds_time, timestamp);
        if self.pos >= self.next_index_pos {
            self.active.index.push(crate::index::Entry { offset, pos: self.pos as u32, timestamp });
            self.next_index_pos = self.pos + crate::index::INDEX_STEP;
        }
        self.pos += aligned;
        self.next_offset += 1;
        if self.pos > self.prefault_trigger {
            self.prefault_trigger = self.pos + prefault::STEP;
            let keep_reserved =
                (self.pos + segment::ALLOCATE_AHEAD - segment::ALLOCATION_STEP).min(self.active.map.len());
            if self.active.map.allocated() < keep_reserved {
                // Errors wait for the write that needs the blocks (above), which reports them.
                let _ = self.allocate(self.pos);
            }
            self.prefaulter.advance(&self.active, self.pos);
            self.shared.options().page_budget.touch(&self.active, Use::Active);
        }
        Ok(offset)
    }

    /// Makes room for a batch of frames taking up to `bytes` before any is written, so that a
    /// full disk fails the batch whole: a new segment when the active one has too little room
    /// left (unless a segment could not hold it either), and the blocks reserved. Returns whether
    /// the batch fits in the active segment now.
    fn make_room(&mut self, bytes: usize) -> Result<bool> {
        let fits_a_segment = (SEGMENT_HEADER_LEN + bytes) as u64 <= self.shared.options().segment_bytes;
        if self.pos + bytes > self.active.map.len() && fits_a_segment {
            self.roll_to(bytes, NextSize::Grown)?;
        }
        let end = self.pos + bytes;
        if end <= self.active.map.len() && end > self.active.map.allocated() {
            self.allocate(end)?;
        }
        Ok(end <= self.active.map.len())
    }

    /// Reserves the active segment's disk blocks for a frame ending at `needed`:
    /// `ALLOCATE_AHEAD` past the writer when the disk has room for that, else only what the
    /// frame needs (a nearly full disk still takes what fits).
    #[cold]
    fn allocate(&mut self, needed: usize) -> Result<()> {
        #[cfg(test)]
        if tests::FAIL_ALLOCATIONS.get() {
            let source = std::io::Error::from_raw_os_error(28); // ENOSPC
            return Err(Error::SegmentAllocation { path: self.active.path.clone(), size: needed as u64, source });
        }
        let ahead = (self.pos + segment::ALLOCATE_AHEAD).next_multiple_of(segment::ALLOCATION_STEP).max(needed);
        if self.active.allocate(ahead).is_ok() {
            return Ok(());
        }
        self.active.allocate(needed)
    }

    /// Gives back the active segment's blocks reserved past the last frame, once no page there
    /// is being faulted in (a fault would take them again); the writer reserves them again if
    /// it reaches them.
    fn release_past_end(&mut self) {
        self.prefaulter.stop();
        self.writer.unallocate_from(self.pos);
        self.active.release_unwritten(self.pos);
    }

    /// Makes everything written so far visible to readers.
    #[inline]
    fn publish(&mut self) {
        debug_assert!(!self.continued, "readers see whole batches");
        self.writer.publish(self.pos);
        self.active.set_tail(self.pos, self.next_offset - self.active.base);
        self.shared.publish(self.next_offset);
    }

    /// Forgets frames written but not published, zeroing them so recovery never sees them.
    fn discard_unpublished(&mut self) {
        let start = self.writer.published_end();
        self.writer.unpublished_mut()[..self.pos - start].fill(0);
        self.pos = start;
        self.next_offset = self.shared.next_offset();
        // The discarded frames may have set the time the next frame would take.
        self.frame_time = None;
        self.continued = false;
        self.active.index.truncate_from(self.next_offset);
        self.next_index_pos = index_resume_pos(&self.active);
    }

    /// Seals the active segment and starts a new one that fits a frame of `needed` bytes (or
    /// replaces the active segment when it holds no record), of the size `size` says. Frames
    /// written but unpublished in the old segment are published only once the new segment
    /// exists, so a failed roll (a full disk) leaves the batch unappended.
    fn roll_to(&mut self, needed: usize, size: NextSize) -> Result<()> {
        let opts = self.shared.options();
        let durable = opts.durability != Durability::None;
        let grown = match (opts.initial_segment_bytes, size) {
            (Some(_), NextSize::Grown) => (self.active.map.len() as u64 * 2).min(opts.segment_bytes),
            (Some(_), NextSize::First) => opts.first_segment_bytes(),
            (None, _) => opts.segment_bytes,
        };
        let smallest = (opts.first_segment_bytes()).max(((SEGMENT_HEADER_LEN + needed) as u64).next_multiple_of(4096));
        let mut len = grown.max(smallest);
        let sealing = self.next_offset > self.active.base;
        if durable && sealing {
            // Synced before the next segment exists, with the frames of a batch written but
            // not yet published: after any crash, a segment with a successor is complete
            // (recovery checks only the last one), and the successor's base follows its last
            // record.
            self.shared.commit().sync_sealed(self.shared.dir(), &self.active)?;
        }
        // When the disk cannot hold the grown segment, halve it down to what this frame needs
        // (and the log's first size): a nearly full disk still takes small appends.
        let next = loop {
            match Segment::create(self.shared.dir(), self.next_offset, len, now_ns(), durable, segment::Place::Any) {
                Ok(next) => break next,
                Err(Error::SegmentAllocation { .. }) if len > smallest => {
                    len = (len / 2).next_multiple_of(4096).max(smallest);
                }
                Err(e) => return Err(e),
            }
        };
        // The new segment is under its name now: if that name cannot be made durable, the log
        // takes no more appends, and the new file goes (best effort): left, it would start
        // where records not published yet (a batch's, discarded now) would have ended.
        if durable && let Err(e) = segment::sync_dir(self.shared.dir()) {
            if sealing {
                // (Not sealing, it took the name of the empty active segment, which keeps it.)
                let _ = std::fs::remove_file(&next.path);
            }
            return Err(self.shared.commit().poison(self.shared.dir(), format!("sync of the log's directory: {e}")));
        }
        if !durable {
            // Nothing synced here: a durable record's sync (`make_durable`) syncs what this
            // sealed and the new segment's name first.
            self.shared.commit().made_without_sync(sealing.then_some(&self.active));
        }
        if !sealing {
            // No record fitted the active segment: the new one, of the same base, took its file's
            // name (`Segment::create` renames over it) and takes its place.
            self.replace_empty(next);
            return Ok(());
        }
        // Publish what is written, then seal: with a durability policy the sealed segment was
        // synced above, so later syncs need only cover the active segment.
        self.publish();
        if durable {
            let (pos, records) = self.active.tail();
            self.active.write_checkpoint(pos as u64, self.active.base + records);
        }
        crate::index::save(self.shared.dir(), self.active.base, &self.active.index.entries());
        if size == NextSize::First || self.active.map.allocated() > self.pos + segment::ALLOCATION_STEP {
            // Sealed well before its end (a record larger than what was left, or a log giving
            // its disk back): its unused blocks go back, as a closing log's do, and the prefault
            // thread lets go of it.
            self.release_past_end();
        }
        self.shared.options().page_budget.touch(&self.active, Use::Sealed);
        // Readers look for the next segment only after reaching the old one's published end,
        // which is final by now (see Reader::advance).
        self.shared.segments_mut().push(Arc::new(next));
        self.start_active();
        self.shared.count_roll();
        // (`give_back` applies it itself, to report what it deleted.)
        if size == NextSize::Grown
            && let Err(e) = crate::retention::apply(&self.shared)
        {
            tracing::warn!(error = %e, "retention failed; will try again at the next roll");
        }
        Ok(())
    }

    /// Puts `next` in the place of the active segment, which holds no record.
    #[cold]
    fn replace_empty(&mut self, next: Segment) {
        assert_eq!(
            (self.next_offset, self.pos),
            (self.active.base, SEGMENT_HEADER_LEN),
            "only an empty segment is replaced"
        );
        assert_eq!(next.base, self.active.base);
        self.prefaulter.stop();
        self.shared.options().page_budget.forget(&self.active);
        {
            let mut segments = self.shared.segments_mut();
            let last = segments.last_mut().expect("the active segment is listed");
            assert!(Arc::ptr_eq(last, &self.active));
            *last = Arc::new(next);
        }
        // After the list holds the new one, so that a reader seeing the mark finds it.
        self.active.replaced.store(true, Ordering::Release);
        self.start_active();
    }

    /// Makes the newest listed segment the one the writer appends to, from its start.
    fn start_active(&mut self) {
        let next = Arc::clone(self.shared.segments().last().expect("a log has a segment"));
        let writer = next.map.writer().expect("a new mapping has its writer");
        self.positions = next.positions();
        self.shared.commit().set_active(Arc::clone(&next));
        self.active = next;
        self.writer = writer;
        self.shared.options().page_budget.touch(&self.active, Use::Active);
        self.pos = SEGMENT_HEADER_LEN;
        self.frame_time = None;
        self.prefault_trigger = SEGMENT_HEADER_LEN;
        self.next_index_pos = SEGMENT_HEADER_LEN;
    }
}

impl Drop for Log {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::error!(dir = %self.shared.dir().display(), error = %e, "final sync failed on close");
        }
    }
}

/// How large a roll makes the next segment (with `Options::initial_segment_bytes`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum NextSize {
    /// Twice the one it seals, up to `segment_bytes`: a log being written grows its segments.
    Grown,
    /// The log's first size: a drained log starts again small (`give_back`).
    First,
}

/// Where the writer's next index entry may start, given the entries the active segment has.
fn index_resume_pos(seg: &Segment) -> usize {
    seg.index.entries().last().map_or(SEGMENT_HEADER_LEN, |e| e.pos as usize + crate::index::INDEX_STEP)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize};

    thread_local! {
        /// Makes this thread's writers fail to reserve disk blocks, as on a full disk.
        pub(super) static FAIL_ALLOCATIONS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    #[test]
    fn a_batch_the_disk_cannot_hold_appends_nothing_even_across_a_segment_boundary() {
        let dir = tempfile::tempdir().unwrap();
        let options = Options { segment_bytes: 16 << 20, initial_segment_bytes: None, ..Options::default() };
        let mut log = Log::open(dir.path(), options.clone()).unwrap();
        let record = vec![5u8; 60 << 10];
        // Fill the first segment to within a record or two of its end.
        while log.pos + 2 * frame::align_up(frame::frame_len(&Input::payload(&record))) < log.active.map.len() {
            log.append(&record).unwrap();
        }
        let before = log.next_offset();
        // A batch of 6 MiB: more than a new segment has reserved when it is made.
        let batch = vec![record.clone(); 100];
        FAIL_ALLOCATIONS.set(true);
        let err = log.append_batch(&batch).unwrap_err();
        FAIL_ALLOCATIONS.set(false);
        assert!(matches!(err, Error::SegmentAllocation { .. }), "{err}");
        assert_eq!(log.next_offset(), before, "nothing of the batch is appended");
        let mut reader = log.reader();
        reader.seek(before);
        assert!(reader.read_next().unwrap().is_none(), "readers see nothing of it");
        assert_eq!(log.append_batch(&batch).unwrap(), before..before + 100, "the disk has room again");
        drop(reader);
        drop(log);
        let log = Log::open(dir.path(), options).unwrap();
        assert_eq!(log.next_offset(), before + 100);
    }

    #[test]
    fn a_failed_sync_poisons_every_later_call() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = Log::open(dir.path(), Options { durability: Durability::Always, ..Options::default() }).unwrap();
        log.append(b"durable").unwrap();
        log.shared.commit().fail_next_sync.store(true, Ordering::Relaxed);
        let err = log.append(b"doomed").unwrap_err();
        assert!(matches!(err, Error::Poisoned(_)), "{err}");
        assert!(matches!(log.append(b"later"), Err(Error::Poisoned(_))));
        assert!(matches!(log.sync(), Err(Error::Poisoned(_))));
        assert!(matches!(log.reader().read_batch(1), Err(Error::Poisoned(_))));
        let shared = log.into_shared();
        assert!(matches!(shared.append(b"shared"), Err(Error::Poisoned(_))));
    }

    #[test]
    fn a_sync_during_which_the_log_is_poisoned_does_not_make_its_records_durable() {
        // The writer sealing a segment syncs it outside the group commit, and the kernel reports
        // a writeback error to one of two syncs of a file only: here the other sync (the
        // append's) succeeds while the sealing one poisons the log.
        let dir = tempfile::tempdir().unwrap();
        let shared: Arc<std::sync::OnceLock<Arc<LogState>>> = Arc::default();
        let poison_from = Arc::clone(&shared);
        let on_sync = crate::SyncObserver::new(move |_| {
            if let Some(state) = poison_from.get() {
                state.commit().poison(state.dir(), "writeback error seen by the sealing sync".into());
            }
        });
        let mut log =
            Log::open(dir.path(), Options { durability: Durability::Always, on_sync, ..Options::default() }).unwrap();
        let _ = shared.set(Arc::clone(&log.shared));
        let err = log.append(b"lost with the pages").unwrap_err();
        assert!(matches!(err, Error::Poisoned(_)), "{err}");
    }

    #[test]
    fn a_segments_syncs_run_one_at_a_time() {
        // The writer sealing a segment syncs it while producers' group-commit syncs may be under
        // way: they take turns (`Commit::sync_file`), so that the failure one of them sees poisons
        // the log before the other's sync begins. The observer runs inside each sync's turn.
        let dir = tempfile::tempdir().unwrap();
        let (in_sync, overlapped) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicBool::new(false)));
        let (inside, seen) = (Arc::clone(&in_sync), Arc::clone(&overlapped));
        let on_sync = crate::SyncObserver::new(move |_| {
            if inside.fetch_add(1, Ordering::SeqCst) > 0 {
                seen.store(true, Ordering::SeqCst);
            }
            std::thread::sleep(std::time::Duration::from_micros(300));
            inside.fetch_sub(1, Ordering::SeqCst);
        });
        let options = Options {
            durability: Durability::Always,
            segment_bytes: crate::MIN_SEGMENT_BYTES,
            initial_segment_bytes: None,
            on_sync,
            ..Options::default()
        };
        let log = Log::open(dir.path(), options).unwrap().into_shared();
        std::thread::scope(|s| {
            for _ in 0..4 {
                let log = &log;
                s.spawn(move || {
                    for _ in 0..300 {
                        log.append(&[7u8; 1024]).unwrap();
                    }
                });
            }
        });
        assert!(log.stats().segments > 4, "the producers filled several segments");
        assert!(!overlapped.load(Ordering::SeqCst), "two syncs of the log at once");
    }

    #[test]
    fn threads_waiting_behind_a_failed_sync_all_get_the_error() {
        const WAITERS: usize = 16;
        let dir = tempfile::tempdir().unwrap();
        let started = Arc::new(std::sync::Barrier::new(WAITERS + 1));
        let in_sync = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (started_in, in_sync_in) = (Arc::clone(&started), Arc::clone(&in_sync));
        // The failing sync is held until every waiter has had time to queue behind it.
        let on_sync = crate::SyncObserver::new(move |_| {
            if !in_sync_in.swap(true, Ordering::SeqCst) {
                started_in.wait();
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
        });
        let log =
            Log::open(dir.path(), Options { durability: Durability::Always, on_sync, ..Options::default() }).unwrap();
        let state = Arc::clone(&log.shared);
        let log = log.into_shared();
        let first = log.append_batch_unsynced(&[Input::payload(b"first")]).unwrap().start;
        let syncer = {
            let log = log.clone();
            std::thread::spawn(move || log.wait_durable(first))
        };
        let waiters: Vec<_> = (0..WAITERS)
            .map(|_| {
                let (log, started, state) = (log.clone(), Arc::clone(&started), Arc::clone(&state));
                std::thread::spawn(move || {
                    // Appended while the first sync is under way, so it does not cover them.
                    started.wait();
                    // (A waiter held up past the next sync finds the log poisoned already.)
                    let offset = log.append_batch_unsynced(&[Input::payload(b"waiting")])?.start;
                    state.commit().fail_next_sync.store(true, Ordering::Relaxed);
                    log.wait_durable(offset)
                })
            })
            .collect();
        let results: Vec<Result<()>> = waiters.into_iter().map(|t| t.join().unwrap()).collect();
        let first = syncer.join().unwrap();
        // The held sync began before the failure was armed; the next one, run by a waiter it
        // did not cover, fails, and every waiter comes back with the poison.
        assert!(first.is_ok(), "{first:?}");
        assert!(results.iter().all(|r| matches!(r, Err(Error::Poisoned(_)))), "{results:?}");
    }
}
