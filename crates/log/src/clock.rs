//! Time for records: nanoseconds since the Unix epoch, and the writer's cheap clock.

pub(crate) fn now_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// The writer's clock. Reading the precise clock costs about as much as the rest of an append,
/// so it is read only when the coarse clock (a few ns; it moves once per kernel tick, 1–4 ms)
/// has moved, when the caller asks (the writer does at the start of each of the dense index's
/// time groups, so that a group's records mostly share its first one's time), or after every
/// `PRECISE_EVERY` uses within a tick. A reading is therefore never more than one tick behind,
/// and under load within a few appends of exact (the writer may then stamp a record up to
/// `log::CLOCK_RESOLUTION_NS` earlier still, with the time the frames before it take).
#[derive(Default)]
pub(crate) struct Clock {
    coarse: u64,
    precise: u64,
    uses: u32,
}

const PRECISE_EVERY: u32 = 16;

impl Clock {
    #[inline]
    pub(crate) fn now(&mut self, refresh: bool) -> u64 {
        let coarse = rustix::time::clock_gettime(rustix::time::ClockId::RealtimeCoarse);
        let coarse = coarse.tv_sec as u64 * 1_000_000_000 + coarse.tv_nsec as u64;
        if coarse != self.coarse || refresh || self.uses >= PRECISE_EVERY {
            self.coarse = coarse;
            self.precise = now_ns();
            self.uses = 0;
        }
        self.uses += 1;
        self.precise
    }
}
