//! Consumer groups: named, independent readers of a log with crash-safe cursors, at-least-once
//! delivery, out-of-order acknowledgements, negative acknowledgements and seeking.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::cursor::{self, CURSOR_FILE_LEN, CursorState, MAX_HELD, MAX_PENDING};
use crate::error::{Error, Reason, Result, corrupt, io_err};
use crate::frame::Record;
use crate::options::{Durability, SyncObserver};
use crate::reader::{Batch, Reader};
use crate::state::LogState;
use crate::syncer::{self, IntervalSync, Registration};

pub(crate) const GROUPS_DIR: &str = "groups";
pub(crate) const CURSOR_SUFFIX: &str = ".cursor";

/// Where a group (re)starts reading.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeekTo {
    /// The oldest record still in the log.
    Oldest,
    /// After the newest record: only records appended from now on.
    Newest,
    /// This offset (clamped to the records in the log).
    Offset(u64),
    /// The first record with a timestamp at or after this many ns since the Unix epoch.
    Time(u64),
}

/// How a group is opened.
#[derive(Clone, Copy, Debug)]
pub struct GroupOptions {
    /// When acknowledgements reach stable storage (same meanings as for the log).
    pub durability: Durability,
    /// Most records delivered and not yet acknowledged; `poll` refuses to deliver more.
    pub max_pending: usize,
    /// Where a group that does not exist yet starts.
    pub start: SeekTo,
    /// A group that does not exist yet is not made when the log has this many (0: no limit):
    /// `Error::TooManyGroups`. Checked under the registry's lock, so that openers at the limit
    /// cannot all pass it at once.
    pub max_groups: usize,
}

impl Default for GroupOptions {
    fn default() -> Self {
        GroupOptions { durability: Durability::None, max_pending: 4096, start: SeekTo::Oldest, max_groups: 0 }
    }
}

/// What is known about a group without opening it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupInfo {
    pub name: String,
    /// Lowest unacknowledged offset.
    pub committed: u64,
    /// Records above `committed` already acknowledged (out of order).
    pub acked_above: usize,
    /// Records the group went on past while they stayed delivered and unacknowledged (held long
    /// by a consumer): `committed` is the lowest of them.
    pub held: usize,
    /// Where the group's window of delivered records starts: `committed` unless records are
    /// held; `acked_above` counts from here.
    pub window_start: u64,
    /// Whether a handle to the group is open in this process.
    pub open: bool,
    /// Records the group lost to retention caps before it read them.
    pub skipped: u64,
}

impl GroupInfo {
    /// Records of a log ending at `end` the group has not acknowledged (those it holds among
    /// them): its lag.
    pub fn unacknowledged(&self, end: u64) -> u64 {
        end.saturating_sub(self.window_start).saturating_sub(self.acked_above as u64) + self.held as u64
    }
}

/// A group's entry in the log's registry: what retention and listings need to know.
pub(crate) struct GroupEntry {
    /// The lowest unacknowledged offset: what retention keeps.
    pub committed: AtomicU64,
    /// Where the window of delivered records starts (`committed` unless records are held):
    /// what retention counts as lost when it removes records the group had not read.
    pub window_start: AtomicU64,
    pub open: AtomicBool,
    pub skipped: AtomicU64,
    /// The offset up to which `skipped` counts what retention removed before this group read
    /// it: a loss is counted once, by retention or by the group's open, whichever sees it first.
    pub skipped_to: AtomicU64,
    pub acked_above: AtomicU64,
    pub held: AtomicU64,
}

pub(crate) type Registry = Mutex<BTreeMap<String, Arc<GroupEntry>>>;

impl GroupEntry {
    fn closed(state: &CursorState) -> Arc<GroupEntry> {
        let entry = GroupEntry {
            committed: AtomicU64::new(0),
            window_start: AtomicU64::new(0),
            open: AtomicBool::new(false),
            skipped: AtomicU64::new(0),
            skipped_to: AtomicU64::new(0),
            acked_above: AtomicU64::new(0),
            held: AtomicU64::new(0),
        };
        entry.show(state.committed, state.acked_above.len(), &state.held);
        Arc::new(entry)
    }

    /// Makes a group's position known as its cursor records it: the window's start
    /// `committed`, `acked_above` acknowledgements above it, and the `held` records below it.
    pub(crate) fn show(&self, committed: u64, acked_above: usize, held: &[u64]) {
        self.window_start.store(committed, Ordering::Release);
        self.committed.store(cursor::lowest_unacknowledged(committed, held), Ordering::Release);
        self.acked_above.store(acked_above as u64, Ordering::Relaxed);
        self.held.store(held.len() as u64, Ordering::Relaxed);
    }
}

/// The registry of a log's groups, from the cursors found at open.
pub(crate) fn registry(cursors: BTreeMap<String, CursorState>) -> Registry {
    Mutex::new(cursors.into_iter().map(|(name, state)| (name, GroupEntry::closed(&state))).collect())
}

/// Every group of the log, open or not.
pub(crate) fn infos(log: &LogState) -> Vec<GroupInfo> {
    log.groups()
        .iter()
        .map(|(name, e)| GroupInfo {
            name: name.clone(),
            committed: e.committed.load(Ordering::Acquire),
            acked_above: e.acked_above.load(Ordering::Relaxed) as usize,
            held: e.held.load(Ordering::Relaxed) as usize,
            window_start: e.window_start.load(Ordering::Acquire),
            open: e.open.load(Ordering::Acquire),
            skipped: e.skipped.load(Ordering::Relaxed),
        })
        .collect()
}

/// Creates group `to` at the position of group `from` (its last written cursor).
pub(crate) fn copy(log: &LogState, from: &str, to: &str) -> Result<()> {
    check_name(to)?;
    let path = cursor_path(log.dir(), from);
    let bytes = match fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Error::NoSuchGroup(from.to_owned())),
        Err(e) => return Err(io_err("read cursor", &path)(e)),
    };
    let (_, state) =
        cursor::read(&bytes).ok_or_else(|| corrupt(&path, 0, None, Reason::Other("no valid cursor slot".into())))?;
    let mut groups = log.groups();
    if groups.contains_key(to) {
        return Err(Error::Config(format!("consumer group {to:?} already exists")));
    }
    create_cursor(log.dir(), to, &state, log.options().durability != Durability::None)?;
    groups.insert(to.to_owned(), GroupEntry::closed(&state));
    Ok(())
}

/// Deletes a group that is not open.
pub(crate) fn delete(log: &LogState, name: &str) -> Result<()> {
    let mut groups = log.groups();
    match groups.get(name) {
        None => return Err(Error::NoSuchGroup(name.to_owned())),
        Some(e) if e.open.load(Ordering::Acquire) => return Err(Error::GroupInUse(name.to_owned())),
        Some(_) => {}
    }
    let path = cursor_path(log.dir(), name);
    fs::remove_file(&path).map_err(io_err("remove cursor", &path))?;
    groups.remove(name);
    Ok(())
}

pub(crate) fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        && !name.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "group name {name:?} must be 1 to 128 characters of A-Z a-z 0-9 . _ - and not start with '.'"
        )))
    }
}

pub(crate) fn cursor_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(GROUPS_DIR).join(format!("{name}{CURSOR_SUFFIX}"))
}

/// Reads every cursor file under `dir/groups`. A file with no valid slot is corruption.
pub(crate) fn load_all(dir: &Path) -> Result<BTreeMap<String, CursorState>> {
    let (out, unreadable) = load_readable(dir)?;
    match unreadable.into_iter().next() {
        Some((_, e)) => Err(e),
        None => Ok(out),
    }
}

/// Groups whose cursor holds no valid slot: each name, and why.
pub type Unreadable = Vec<(String, Error)>;

/// `load_all`, with the cursors that hold no valid slot apart (name and why): for the read-only
/// tools, which show a log whose cursor is damaged rather than refuse it.
pub(crate) fn load_readable(dir: &Path) -> Result<(BTreeMap<String, CursorState>, Unreadable)> {
    let groups = dir.join(GROUPS_DIR);
    let (mut out, mut unreadable) = (BTreeMap::new(), Vec::new());
    let entries = match fs::read_dir(&groups) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((out, unreadable)),
        Err(e) => return Err(io_err("list groups", &groups)(e)),
    };
    for entry in entries {
        let entry = entry.map_err(io_err("list groups", &groups))?;
        let file_name = entry.file_name();
        let Some(name) = file_name.to_str().and_then(|n| n.strip_suffix(CURSOR_SUFFIX)) else {
            continue; // a leftover `.tmp` or a foreign file
        };
        match read_cursor(&entry.path()) {
            Ok(state) => drop(out.insert(name.to_owned(), state)),
            Err(e @ Error::Corrupt { .. }) => unreadable.push((name.to_owned(), e)),
            // (Deleted since the listing: a group removed beside a running server.)
            Err(Error::Io { ref source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok((out, unreadable))
}

/// What the cursor file at `path` holds. One that is empty or all zeros never reached the disk
/// (a power loss soon after its group was made: it is written unsynced unless the group's
/// durability says otherwise, and a file system may keep its name and not its bytes): the group
/// starts again at the log's oldest record, its messages delivered again (at least once), as
/// for any position a power loss took.
pub(crate) fn read_cursor(path: &Path) -> Result<CursorState> {
    let bytes = fs::read(path).map_err(io_err("read cursor", path))?;
    match cursor::read(&bytes) {
        Some((_, state)) => Ok(state),
        None if bytes.iter().all(|&b| b == 0) => {
            tracing::warn!(cursor = %path.display(), "a consumer group's cursor never reached the disk: the group starts again at the oldest record");
            Ok(CursorState::default())
        }
        None => Err(corrupt(path, 0, None, Reason::Other("no valid cursor slot".into()))),
    }
}

/// Writes a new cursor file for `name` with `state`, atomically (temporary file, rename), and
/// returns it open for reading and writing.
pub(crate) fn create_cursor(dir: &Path, name: &str, state: &CursorState, durable: bool) -> Result<File> {
    let groups = dir.join(GROUPS_DIR);
    let made_groups = !groups.is_dir();
    fs::create_dir_all(&groups).map_err(io_err("create directory", &groups))?;
    if durable && made_groups {
        // The directory's own name, or a power loss could take it and every cursor in it.
        crate::segment::sync_dir(dir)?;
    }
    let path = cursor_path(dir, name);
    let tmp = path.with_extension("cursor.tmp");
    let mut bytes = vec![0u8; CURSOR_FILE_LEN];
    let mut bitmap = Vec::new();
    cursor::bitmap(state.committed, state.acked_above.iter().copied(), &mut bitmap);
    cursor::write(&mut bytes, 1, state.committed, &bitmap, &state.held);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .map_err(io_err("write cursor", &tmp))?;
    file.write_all(&bytes).map_err(io_err("write cursor", &tmp))?;
    if durable {
        file.sync_all().map_err(io_err("sync cursor", &tmp))?;
    }
    fs::rename(&tmp, &path).map_err(io_err("rename cursor", &path))?;
    if durable {
        crate::segment::sync_dir(&groups)?;
    }
    Ok(file)
}

/// A named consumer group, open for reading. One handle per group at a time; use it from one
/// thread (it is `Send`). Dropping it syncs its cursor (unless durability is `None`).
pub struct ConsumerGroup {
    /// The directory's lock, while the group lives (its cursor file is written only under it).
    _lock: Option<Arc<std::fs::File>>,
    shared: Arc<LogState>,
    name: String,
    options: GroupOptions,
    cursor: CursorFile,
    /// Reads new records at `next`.
    reader: Reader,
    /// Reads records to redeliver.
    redelivery: Reader,
    /// Lowest unacknowledged offset.
    committed: u64,
    /// Next offset never delivered yet.
    next: u64,
    /// Acknowledgement flags of `[committed, next)`; the front is always `false`.
    acked: VecDeque<bool>,
    acked_above: usize,
    /// Pending offsets to deliver again before new records (`nack`).
    redeliver: BTreeSet<u64>,
    /// Offsets at or above `next` acknowledged (before a restart, or read after a record taken
    /// back with `unpoll`) that must not be delivered again.
    skip: BTreeSet<u64>,
    /// Offsets below `committed` delivered and not acknowledged: the window moved over them
    /// when they held it full (`poll`). At most `MAX_HELD`; after a restart they are delivered
    /// again first.
    /// (Ascending: a slice for the cursor, and few enough that a search is quick.)
    held: Vec<u64>,
}

/// The open cursor file of a group and what keeps it durable.
struct CursorFile {
    path: PathBuf,
    map: memmap2::MmapMut,
    seq: u64,
    bitmap: Vec<u8>,
    durability: Durability,
    syncer: Option<CursorSyncer>,
    /// The group's entry in the log's registry, kept current.
    entry: Arc<GroupEntry>,
    /// The log's observer of syncs: told of this cursor's too.
    on_sync: SyncObserver,
    /// Why a sync of this cursor under `always` failed: the group takes no more changes (the
    /// `interval` syncer keeps its own), as a log takes no appends after a failed sync.
    failed: Option<String>,
    /// The next sync fails as a disk's would (tests of the failure above).
    #[cfg(test)]
    fail_next_sync: bool,
}

impl CursorFile {
    /// A sync of this cursor failed before: nothing more may change it.
    fn check(&self) -> Result<()> {
        if let Some(e) = &self.failed {
            return Err(Error::Poisoned(format!("cursor sync failed: {e}")));
        }
        self.syncer.as_ref().and_then(CursorSyncer::error).map_or(Ok(()), Err)
    }

    /// Writes the cursor (a memory write into the mapped file) and syncs it as the policy says.
    /// `acked_above`: the acknowledged offsets above `committed`, ascending; `count` of them;
    /// `held`: the unacknowledged ones below it.
    fn persist(
        &mut self,
        committed: u64,
        acked_above: impl Iterator<Item = u64>,
        count: usize,
        held: &[u64],
    ) -> Result<()> {
        self.check()?;
        if count == 0 {
            self.bitmap.clear();
        } else {
            cursor::bitmap(committed, acked_above, &mut self.bitmap);
        }
        self.seq += 1;
        cursor::write(&mut self.map, self.seq, committed, &self.bitmap, held);
        self.entry.show(committed, count, held);
        match (&self.durability, &self.syncer) {
            (Durability::Always, _) => self.sync(),
            (Durability::Interval(_), Some(syncer)) => syncer.mark_dirty(),
            _ => Ok(()),
        }
    }

    fn sync(&mut self) -> Result<()> {
        self.check()?;
        // Through the mapping (msync): the file is not kept open.
        let synced = self.on_sync.time(|| self.map.flush());
        #[cfg(test)]
        let synced = match std::mem::take(&mut self.fail_next_sync) {
            true => Err(std::io::Error::other("a failing disk (test)")),
            false => synced,
        };
        if let Err(e) = &synced {
            self.failed = Some(format!("{}: {e}", self.path.display()));
        }
        synced.map_err(io_err("sync cursor", &self.path))
    }
}

/// Waits for records appended to a group's log, without the group (`ConsumerGroup::appends`):
/// for a caller that keeps its group behind a lock of its own, so that waiting for records
/// does not hold that lock (another thread's `ack` would wait behind the wait).
#[derive(Clone)]
pub struct Appends(Arc<LogState>);

/// When a wait of `timeout` from now ends; a timeout too large for the clock (`Duration::MAX`:
/// "no limit") waits about a century.
fn deadline_after(timeout: Duration) -> Instant {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
    let now = Instant::now();
    now.checked_add(timeout).or_else(|| now.checked_add(CENTURY)).unwrap_or(now)
}

impl Appends {
    /// The log's end now: what `wait_past` waits beyond. Read it before looking for records,
    /// so that one appended in between ends the wait.
    pub fn end(&self) -> u64 {
        self.0.next_offset()
    }

    /// Waits up to `timeout` for a record at `end` or after; whether one came (or the log can
    /// take no more: a failed sync).
    pub fn wait_past(&self, end: u64, timeout: Duration) -> bool {
        self.0.wait_for_append(end, deadline_after(timeout))
    }
}

impl ConsumerGroup {
    /// What waits for records appended to this group's log without the group.
    pub fn appends(&self) -> Appends {
        Appends(Arc::clone(&self.shared))
    }

    pub(crate) fn open(shared: Arc<LogState>, name: &str, options: GroupOptions) -> Result<ConsumerGroup> {
        check_name(name)?;
        options.durability.check()?;
        if options.max_pending == 0 || options.max_pending > MAX_PENDING {
            return Err(Error::Config(format!("max_pending must be between 1 and {MAX_PENDING}")));
        }
        let (entry, made) = {
            let mut groups = shared.groups();
            // A new group holds the whole log from retention until its cursor says where it
            // starts: retention, which reads this registry under its lock, could otherwise
            // delete the records it was about to start at.
            let made = !groups.contains_key(name);
            if made && options.max_groups != 0 && groups.len() >= options.max_groups {
                return Err(Error::TooManyGroups { groups: groups.len(), max: options.max_groups });
            }
            let entry = groups.entry(name.to_owned()).or_insert_with(|| {
                let entry =
                    GroupEntry::closed(&CursorState { committed: shared.first_offset(), ..CursorState::default() });
                // Not yet anywhere: what a cap removes meanwhile is not counted as its loss.
                entry.window_start.store(u64::MAX, Ordering::Release);
                entry
            });
            if entry.open.swap(true, Ordering::AcqRel) {
                return Err(Error::GroupInUse(name.to_owned()));
            }
            (Arc::clone(entry), made)
        };
        match Self::open_file(Arc::clone(&shared), name, options, Arc::clone(&entry)) {
            Ok(group) => Ok(group),
            Err(e) => {
                entry.open.store(false, Ordering::Release);
                if made {
                    // Not made after all: it holds nothing back.
                    let mut groups = shared.groups();
                    if groups.get(name).is_some_and(|e| Arc::ptr_eq(e, &entry)) {
                        groups.remove(name);
                    }
                }
                Err(e)
            }
        }
    }

    fn open_file(shared: Arc<LogState>, name: &str, options: GroupOptions, entry: Arc<GroupEntry>) -> Result<Self> {
        let path = cursor_path(shared.dir(), name);
        // A cursor file made now is synced if the group's durability or the log's asks for
        // syncs: a power loss must not take a durable log's group (as a `dedup` group holding
        // back idempotency keys) whose records outlive it. Once, at its making.
        let durable = options.durability != Durability::None || shared.options().durability != Durability::None;
        let file = match OpenOptions::new().read(true).write(true).open(&path) {
            Ok(file) => {
                let len = file.metadata().map_err(io_err("stat cursor", &path))?.len();
                let bytes = fs::read(&path).map_err(io_err("read cursor", &path))?;
                if bytes.iter().all(|&b| b == 0) {
                    // Never reached the disk (`read_cursor`): made again, from the oldest record.
                    drop(file);
                    create_cursor(shared.dir(), name, &CursorState::default(), durable)?
                } else if len != CURSOR_FILE_LEN as u64 {
                    return Err(corrupt(
                        &path,
                        0,
                        None,
                        Reason::Other(format!("cursor file is {len} bytes, not {CURSOR_FILE_LEN}")),
                    ));
                } else {
                    file
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let start = resolve(&shared, options.start)?;
                let state = CursorState { committed: start, ..CursorState::default() };
                create_cursor(shared.dir(), name, &state, durable)?
            }
            Err(e) => return Err(io_err("open cursor", &path)(e)),
        };
        let map = crate::mmap::map_private_file(&file, CURSOR_FILE_LEN).map_err(io_err("map cursor", &path))?;
        let Some((seq, state)) = cursor::read(&map) else {
            return Err(corrupt(&path, 0, None, Reason::Other("no valid cursor slot".into())));
        };
        let first = shared.first_offset();
        // Retention removed records this group had not read (unless it counted them already).
        let counted = state.committed.max(entry.skipped_to.fetch_max(first, Ordering::AcqRel));
        entry.skipped.fetch_add(first.saturating_sub(counted), Ordering::Relaxed);
        let state = state.within(first, u64::MAX);
        let committed = state.committed;
        entry.show(committed, state.acked_above.len(), &state.held);
        let skip: BTreeSet<u64> = state.acked_above.into_iter().collect();
        let held = state.held; // (ascending: `cursor::read` checks)
        let on_sync = shared.commit().on_sync().clone();
        let syncer = match options.durability {
            Durability::Interval(every) => Some(CursorSyncer::start(&file, every, on_sync.clone())?),
            _ => None,
        };
        drop(file); // the mappings hold it
        let mut reader = Reader::new(Arc::clone(&shared));
        reader.seek(committed);
        let redelivery = Reader::new(Arc::clone(&shared));
        Ok(ConsumerGroup {
            _lock: shared.lock(),
            shared,
            name: name.to_owned(),
            options,
            cursor: CursorFile {
                path,
                map,
                seq,
                bitmap: Vec::new(),
                durability: options.durability,
                syncer,
                entry,
                on_sync,
                failed: None,
                #[cfg(test)]
                fail_next_sync: false,
            },
            reader,
            redelivery,
            committed,
            next: committed,
            acked: VecDeque::new(),
            acked_above: 0,
            // Held before the restart: the oldest records, delivered again first.
            redeliver: held.iter().copied().collect(),
            skip,
            held,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Lowest unacknowledged offset: where the group resumes after a restart.
    pub fn committed(&self) -> u64 {
        cursor::lowest_unacknowledged(self.committed, &self.held)
    }

    /// Records delivered and not acknowledged.
    pub fn pending(&self) -> usize {
        (self.next - self.committed) as usize - self.acked_above + self.held.len()
    }

    /// Whether the records delivered and not acknowledged may stop `poll` letting more out
    /// (`TooManyPending`) before every record is read, even as each one read is acknowledged:
    /// `max_pending` of them, or more than the window can hold as it moves on (`MAX_HELD`).
    /// Errs towards `true` (the window may move over fewer, and returned ones go out
    /// regardless).
    pub fn may_block(&self) -> bool {
        let pending = self.pending();
        pending >= self.options.max_pending || pending > MAX_HELD
    }

    /// Whether `poll` would refuse a new record now (`TooManyPending`): `max_pending` records
    /// out, or the window as wide and no room to hold its oldest. Unlike `may_block`, not before.
    pub fn would_block(&self) -> bool {
        let span = (self.next - self.committed) as usize;
        self.pending() >= self.options.max_pending || (span >= self.options.max_pending && self.held.len() >= MAX_HELD)
    }

    /// Of the `pending` records, those `poll` hands out again before any new one: returned
    /// with `nack`, or held by the group before it was last opened (whoever read them then is
    /// gone). A reader that limits what it has out counts `pending` less these.
    pub fn redeliveries(&self) -> usize {
        self.redeliver.len()
    }

    /// Records in the log from the lowest unacknowledged one on (acknowledged ones among them
    /// included: see `unacknowledged`).
    pub fn lag(&self) -> u64 {
        self.shared.next_offset().saturating_sub(self.committed())
    }

    /// Records in the log that the group has not acknowledged: exactly, whatever order the
    /// acknowledgements came in, before a restart or after.
    pub fn unacknowledged(&self) -> u64 {
        // `skip` holds offsets at or above `next` (a poll never reads past one), `acked_above`
        // those below it, `held` those below the window: none counts an offset another does.
        let from_window = self.shared.next_offset().saturating_sub(self.committed);
        from_window - self.acked_above as u64 - self.skip.len() as u64 + self.held.len() as u64
    }

    /// Whether the group has acknowledged `offset` (before a restart or since).
    pub fn is_acknowledged(&self, offset: u64) -> bool {
        if offset < self.committed {
            return self.held.binary_search(&offset).is_err();
        }
        if offset < self.next {
            return self.acked[(offset - self.committed) as usize];
        }
        self.skip.contains(&offset)
    }

    /// Up to `max` records: first any `nack`ed ones (one at a time, lowest offset first), then
    /// new ones in order. Waits up to `timeout` for a record when there is none, woken by the
    /// writer (no spinning). An empty batch means the timeout passed.
    ///
    /// Fails with `TooManyPending` when `max_pending` records are delivered and unacknowledged,
    /// or when the window of records from the oldest unacknowledged one on is `max_pending`
    /// long and `MAX_HELD` records are held already (see `hold_oldest`).
    pub fn poll(&mut self, max: usize, timeout: Duration) -> Result<Batch<'_>> {
        self.poll_within(max, usize::MAX, timeout)
    }

    /// `poll`, stopping once the records taken fill `max_bytes` of frames (at least one record):
    /// for a consumer that copies what it polls, so that a batch of large records is bounded.
    pub fn poll_within(&mut self, max: usize, max_bytes: usize, timeout: Duration) -> Result<Batch<'_>> {
        self.poll_before(max, max_bytes, timeout, u64::MAX)
    }

    /// `poll_within` of records before offset `end` only (what the writer's caller has made
    /// visible: a record appended and not yet synced, say). Does not wait for records at or
    /// past `end`: an empty batch at once when only those are left.
    pub fn poll_before(&mut self, max: usize, max_bytes: usize, timeout: Duration, end: u64) -> Result<Batch<'_>> {
        self.shared.check_poison()?;
        self.catch_up_with_retention()?;
        if max == 0 {
            return Ok(Batch::default());
        }
        // (Taken out of `redeliver` once read: a read that fails leaves it to be delivered again.)
        while let Some(&offset) = self.redeliver.first().filter(|&&o| o < end) {
            self.redelivery.seek(offset);
            if self.redelivery.next_readable()? == Some(offset) {
                let batch = self.redelivery.read_batch(1)?;
                self.redeliver.remove(&offset);
                return Ok(batch);
            }
            self.redeliver.remove(&offset);
            // Retention removed it since the catch-up above (held records are the oldest):
            // caught up with again, the next one.
            self.catch_up_with_retention()?;
        }
        let deadline = deadline_after(timeout);
        loop {
            self.pass_acknowledged();
            if self.pending() >= self.options.max_pending {
                return Err(Error::TooManyPending { group: self.name.clone(), max: self.options.max_pending });
            }
            self.hold_oldest()?;
            let span = (self.next - self.committed) as usize;
            if span >= self.options.max_pending {
                return Err(Error::TooManyPending { group: self.name.clone(), max: self.options.max_pending });
            }
            // Held records are pending too, outside the window: `pending()` is below
            // `max_pending` (checked above, and holding does not change it).
            let mut allowed =
                max.min(self.options.max_pending - span).min(self.options.max_pending - self.pending()) as u64;
            if let Some(&s) = self.skip.first() {
                allowed = allowed.min(s - self.next);
            }
            if end <= self.next {
                return Ok(Batch::default());
            }
            allowed = allowed.min(end - self.next);
            if self.reader.position() != self.next {
                self.reader.seek(self.next);
            }
            if self.shared.next_offset() > self.next {
                if self.reader.next_readable()?.is_some_and(|at| at != self.next) {
                    // Retention removed records from `next` on since the catch-up above (the
                    // reader steps over them): caught up with again, so that what is delivered
                    // is counted where it is.
                    self.catch_up_with_retention()?;
                    continue;
                }
                let batch = self.reader.read_batch_within(allowed as usize, max_bytes)?;
                self.acked.extend(std::iter::repeat_n(false, batch.len()));
                self.next += batch.len() as u64;
                return Ok(batch);
            }
            if max == 0 || !self.shared.wait_for_append(self.next, deadline) {
                return Ok(Batch::default());
            }
        }
    }

    /// The next record, acknowledged before it is returned: at-most-once, the shape of a plain
    /// queue's dequeue. Waits up to `timeout` for one; `None` if none came.
    pub fn take(&mut self, timeout: Duration) -> Result<Option<Record<'_>>> {
        self.shared.check_poison()?;
        self.cursor.check()?;
        self.catch_up_with_retention()?;
        self.pass_acknowledged();
        if !self.redeliver.is_empty() || !self.skip.is_empty() || self.next != self.committed {
            // Records are pending: go the general way, then read the record again.
            let Some(offset) = self.poll(1, timeout)?.into_iter().next().map(|r| r.offset) else {
                return Ok(None);
            };
            // Found again before it is acknowledged: the reader then holds its segment, which
            // retention may delete as soon as the acknowledgement lets it.
            self.redelivery.seek(offset);
            let found = self.redelivery.next_readable()?;
            self.ack(offset)?;
            if found != Some(offset) {
                // Removed by a cap since the poll: taken, and gone; the next one instead.
                return self.take(timeout);
            }
            return Ok(self.redelivery.read_batch(1)?.into_iter().next().filter(|r| r.offset == offset));
        }
        let deadline = deadline_after(timeout);
        while self.shared.next_offset() <= self.next {
            if !self.shared.wait_for_append(self.next, deadline) {
                return Ok(None);
            }
        }
        if self.reader.position() != self.next {
            self.reader.seek(self.next);
        }
        if self.reader.next_readable()?.is_some_and(|at| at != self.next) {
            // Retention removed the record at `next` since the catch-up above: caught up with
            // again.
            self.catch_up_with_retention()?;
            return self.take(timeout);
        }
        let record = self.reader.read_batch(1)?.into_iter().next();
        if record.is_some() {
            self.next += 1;
            self.committed += 1;
            self.cursor.persist(self.committed, std::iter::empty(), 0, &self.held)?;
        }
        Ok(record)
    }

    /// Lets go of the segments this group's readers stand in; they find their place again at
    /// their next read. For a group that read a log to its end when retention then deleted the
    /// segment it ended in (`Log::give_back`): a file still mapped keeps its disk, until the
    /// group's next poll otherwise.
    pub fn let_go_of_segments(&mut self) {
        self.reader = Reader::new(Arc::clone(&self.shared));
        self.reader.seek(self.next);
        self.redelivery = Reader::new(Arc::clone(&self.shared));
    }

    /// The record `take` would return now, without taking it (and without waiting).
    pub fn peek(&mut self) -> Result<Option<Record<'_>>> {
        self.shared.check_poison()?;
        // (Past what retention removed: else the head it took would hide the rest for good.)
        self.catch_up_with_retention()?;
        self.pass_acknowledged();
        let offset = self.redeliver.first().copied().unwrap_or(self.next);
        self.redelivery.seek(offset);
        Ok(self.redelivery.read_batch(1)?.into_iter().next().filter(|r| r.offset == offset))
    }

    /// The offset of the record `peek` would return now (`None`: none yet), without reading it:
    /// for a caller that only asks whether there is one.
    pub fn head_offset(&mut self) -> Result<Option<u64>> {
        self.shared.check_poison()?;
        self.catch_up_with_retention()?;
        self.pass_acknowledged();
        Ok(match self.redeliver.first() {
            Some(&offset) => Some(offset),
            None => (self.next < self.shared.next_offset()).then_some(self.next),
        })
    }

    /// While the window of delivered records (`committed..next`) is full and its oldest record
    /// is still unacknowledged, moves the window over it and names it among the held records,
    /// `MAX_HELD` at most: a record one consumer holds long (an open read, a slow job) does not
    /// stop the group after `max_pending` more. A held record stays pending: acknowledged,
    /// returned, or delivered again after a restart like any other.
    fn hold_oldest(&mut self) -> Result<()> {
        let before = self.held.len();
        while (self.next - self.committed) as usize >= self.options.max_pending && self.held.len() < MAX_HELD {
            assert_eq!(self.acked.pop_front(), Some(false), "the window starts at an unacknowledged record");
            self.held.push(self.committed); // (above every one held before: ascending)
            self.committed += 1;
            self.advance_committed();
        }
        if self.held.len() == before {
            return Ok(());
        }
        self.persist()
    }

    /// Moves past records that retention deleted before this group read them (already counted
    /// in the group's `skipped` by retention).
    fn catch_up_with_retention(&mut self) -> Result<()> {
        let first = self.shared.first_offset();
        if self.committed() >= first {
            return Ok(());
        }
        let held = self.held.len();
        self.held.retain(|&o| o >= first);
        // (Retention counts what it removes from the window on; held records it removed, here.)
        self.cursor.entry.skipped.fetch_add((held - self.held.len()) as u64, Ordering::Relaxed);
        if self.committed < first {
            let gone = (first - self.committed) as usize;
            if gone >= self.acked.len() {
                self.acked.clear();
                self.next = first;
            } else {
                self.acked.drain(..gone);
            }
            self.committed = first;
            self.acked_above = self.acked.iter().filter(|a| **a).count();
            self.advance_committed();
        }
        self.redeliver.retain(|&o| o >= first);
        self.skip.retain(|&o| o >= first);
        // Acknowledged before a restart, at the new start: stepped over before the cursor is
        // written (it holds only acknowledgements above `committed`).
        self.pass_acknowledged();
        self.persist()
    }

    /// Steps over records acknowledged before a restart (they are not delivered again).
    fn pass_acknowledged(&mut self) {
        while self.skip.first() == Some(&self.next) {
            self.skip.pop_first();
            self.acked.push_back(true);
            self.acked_above += 1;
            self.next += 1;
            self.advance_committed();
        }
    }

    /// Acknowledges a delivered record. Acknowledging one twice, or one below `committed`, is a
    /// no-op; acknowledging one never delivered is an error.
    pub fn ack(&mut self, offset: u64) -> Result<()> {
        // (Before anything changes: a retry after a failed sync must not pass as done.)
        self.cursor.check()?;
        if offset == self.committed
            && offset < self.next
            && self.acked_above == 0
            && self.skip.is_empty()
            && self.redeliver.is_empty()
        {
            // The common case, in order: the oldest pending record, none acknowledged above it,
            // nothing to step over or deliver again. The group passes it; the cursor holds no
            // bitmap.
            debug_assert_eq!(self.acked.front(), Some(&false));
            self.acked.pop_front();
            self.committed += 1;
            return self.cursor.persist(self.committed, std::iter::empty(), 0, &self.held);
        }
        if offset < self.committed {
            let Ok(i) = self.held.binary_search(&offset) else { return Ok(()) };
            self.held.remove(i);
            self.redeliver.remove(&offset);
            return self.persist();
        }
        if offset >= self.next {
            if self.skip.contains(&offset) {
                return Ok(()); // acknowledged already (before a restart, or an `unpoll`)
            }
            return Err(Error::NotDelivered { group: self.name.clone(), offset });
        }
        let i = (offset - self.committed) as usize;
        if self.acked[i] {
            return Ok(());
        }
        self.acked[i] = true;
        self.acked_above += 1;
        self.redeliver.remove(&offset);
        self.advance_committed();
        self.pass_acknowledged();
        self.persist()
    }

    /// Returns a delivered, unacknowledged record to be delivered again before newer records.
    pub fn nack(&mut self, offset: u64) -> Result<()> {
        let in_window = offset >= self.committed && offset < self.next;
        let pending =
            self.held.binary_search(&offset).is_ok() || in_window && !self.acked[(offset - self.committed) as usize];
        if !pending {
            return Err(Error::NotDelivered { group: self.name.clone(), offset });
        }
        self.redeliver.insert(offset);
        Ok(())
    }

    /// Takes back the last unacknowledged record `poll` delivered, as if it had never been
    /// delivered: unlike `nack`, it stops counting against `max_pending`, and the next poll reads
    /// it in order with those after it. Records read after it and acknowledged (markers a reader
    /// stepped over) stay acknowledged, to be stepped over again. `false` (nothing changed)
    /// unless `offset` is that record.
    pub fn unpoll(&mut self, offset: u64) -> bool {
        if offset < self.committed || offset >= self.next || self.redeliver.contains(&offset) {
            return false;
        }
        let at = (offset - self.committed) as usize;
        if self.acked[at] || !self.acked.range(at + 1..).all(|acked| *acked) {
            return false;
        }
        // (Above the new `next`, as `skip` holds: a poll stops at the first, and steps over it.)
        self.skip.extend(offset + 1..self.next);
        self.acked_above -= (self.next - offset - 1) as usize;
        self.acked.truncate(at);
        self.next = offset;
        true
    }

    /// Moves the group: everything before the new position counts as acknowledged, everything
    /// after it as never delivered. Returns the offset the group now stands at.
    pub fn seek(&mut self, to: SeekTo) -> Result<u64> {
        // Found and shown to retention under the registry's lock, which retention holds while
        // it decides: what the group is about to read back is not deleted meanwhile.
        let target = resolve(&self.shared, to)?; // (a time looked up outside the lock)
        let target = {
            let _groups = self.shared.groups();
            let target = target.max(self.shared.first_offset());
            self.cursor.entry.show(target, 0, &[]);
            target
        };
        self.committed = target;
        self.next = target;
        self.acked.clear();
        self.acked_above = 0;
        self.redeliver.clear();
        self.skip.clear();
        self.held.clear();
        self.reader.seek(target);
        self.persist()?;
        Ok(target)
    }

    fn advance_committed(&mut self) {
        while self.acked.front() == Some(&true) {
            self.acked.pop_front();
            self.acked_above = self.acked_above.checked_sub(1).expect("an acknowledgement above committed was counted");
            self.committed += 1;
        }
    }

    /// Writes the cursor: the committed offset and every acknowledgement above it — those of
    /// this session and those from before a restart not yet passed.
    fn persist(&mut self) -> Result<()> {
        let committed = self.committed;
        let this_session = self.acked.iter().enumerate().filter(|(_, a)| **a).map(|(i, _)| committed + i as u64);
        let acked_above = this_session.chain(self.skip.iter().copied());
        self.cursor.persist(committed, acked_above, self.acked_above + self.skip.len(), &self.held)
    }
}

impl Drop for ConsumerGroup {
    fn drop(&mut self) {
        self.cursor.syncer.take();
        if self.options.durability != Durability::None
            && let Err(e) = self.cursor.sync()
        {
            tracing::error!(group = %self.name, error = %e, "final cursor sync failed");
        }
        self.cursor.entry.open.store(false, Ordering::Release);
    }
}

/// The offset `to` stands for in the log now.
pub(crate) fn resolve(shared: &Arc<LogState>, to: SeekTo) -> Result<u64> {
    let first = shared.first_offset();
    let end = shared.next_offset();
    Ok(match to {
        SeekTo::Oldest => first,
        SeekTo::Newest => end,
        SeekTo::Offset(o) => o.clamp(first, end),
        SeekTo::Time(t) => Reader::new(Arc::clone(shared)).offset_at_time(t)?,
    })
}

/// A cursor file's background sync under `Durability::Interval`, by the process's sync thread
/// (`syncer.rs`).
struct CursorSyncer {
    target: Arc<CursorSync>,
    _registration: Registration,
}

/// What the sync thread holds of a cursor: its own read-only mapping of the file (an msync
/// through it syncs the file, whichever mapping wrote the pages), whether it was written since
/// the last sync, and the first failure, which every later write reports.
struct CursorSync {
    map: memmap2::MmapRaw,
    on_sync: SyncObserver,
    dirty: AtomicBool,
    error: Mutex<Option<String>>,
}

impl IntervalSync for CursorSync {
    fn sync_now(&self) {
        if self.dirty.swap(false, Ordering::AcqRel)
            && let Err(e) = self.on_sync.time(|| self.map.flush())
        {
            self.error.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(e.to_string());
        }
    }
}

impl CursorSyncer {
    fn start(file: &File, every: Duration, on_sync: SyncObserver) -> Result<CursorSyncer> {
        let map = memmap2::MmapOptions::new().map_raw_read_only(file).map_err(io_err("map cursor", PathBuf::new()))?;
        let target = Arc::new(CursorSync { map, on_sync, dirty: AtomicBool::new(false), error: Mutex::new(None) });
        let weak: Weak<dyn IntervalSync> = Arc::downgrade(&target) as Weak<CursorSync>;
        Ok(CursorSyncer { _registration: syncer::register(weak, every)?, target })
    }

    fn mark_dirty(&self) -> Result<()> {
        if let Some(e) = self.error() {
            return Err(e);
        }
        self.target.dirty.store(true, Ordering::Release);
        Ok(())
    }

    fn error(&self) -> Option<Error> {
        let error = self.target.error.lock().unwrap_or_else(|e| e.into_inner());
        error.as_ref().map(|e| Error::Poisoned(format!("cursor sync failed: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A group whose cursor sync failed under `always` takes no more changes: the failed
    /// acknowledgement took in memory, but a retry would pass without a sync, and a take would
    /// go on past the record whose cursor is not on disk.
    #[test]
    fn a_group_whose_cursor_sync_failed_takes_no_more_changes() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = crate::Log::open(dir.path(), crate::Options::default()).unwrap();
        for _ in 0..3 {
            log.append(b"x").unwrap();
        }
        let options = crate::GroupOptions { durability: Durability::Always, ..crate::GroupOptions::default() };
        let mut g = log.group("g", options).unwrap();
        assert_eq!(g.poll(2, Duration::ZERO).unwrap().len(), 2);
        g.cursor.fail_next_sync = true;
        assert!(matches!(g.ack(0), Err(Error::Io { .. })), "the failed sync is reported");
        assert!(g.is_acknowledged(0), "it took in memory all the same");
        assert!(matches!(g.ack(1), Err(Error::Poisoned(_))));
        assert!(matches!(g.take(Duration::ZERO), Err(Error::Poisoned(_))));
    }
}
