//! A fixed-window counter: how the server bounds things that come in bursts over time (logins
//! per address per minute, refusal handshakes and failure log lines per second).

use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug)]
pub(crate) struct FixedWindow {
    start: Instant,
    count: u32,
}

impl FixedWindow {
    pub(crate) fn new(now: Instant) -> FixedWindow {
        FixedWindow { start: now, count: 0 }
    }

    /// Counts an event at `now` in windows of `length` (a new one begins at the first event
    /// past the last); whether it is among the first `max` of its window.
    pub(crate) fn admit(&mut self, now: Instant, length: Duration, max: u32) -> bool {
        if self.ended(now, length) {
            *self = FixedWindow::new(now);
        }
        self.count = self.count.saturating_add(1);
        self.count <= max
    }

    /// Events counted in the window.
    pub(crate) fn count(&self) -> u32 {
        self.count
    }

    /// Whether the window of `length` has passed at `now`.
    pub(crate) fn ended(&self, now: Instant, length: Duration) -> bool {
        now.duration_since(self.start) >= length
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_admits_its_first_events_and_a_new_one_begins_after_it() {
        let (start, second, max) = (Instant::now(), Duration::from_secs(1), 16);
        let at = |ms| start + Duration::from_millis(ms);
        let mut window = FixedWindow::new(start);
        let first: Vec<bool> = (0..20).map(|i| window.admit(at(i * 10), second, max)).collect();
        assert_eq!(first.iter().filter(|t| **t).count(), max as usize);
        assert!(first[..max as usize].iter().all(|t| *t), "the first ones");
        assert!(!window.admit(at(999), second, max));
        assert!(window.admit(at(1000), second, max), "a new second");
        assert!(!window.ended(at(1999), second) && window.ended(at(2000), second));
    }
}
