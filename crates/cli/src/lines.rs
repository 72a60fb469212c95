//! Stdin as batches of lines: one line (blocking for it), then every whole line already
//! buffered, up to a bound. Tools that append or offer each line use it so that a fast producer
//! gets batches and a slow one gets each line at once.

use std::io::{self, BufRead, BufReader, StdinLock};

pub struct StdinLines {
    input: BufReader<StdinLock<'static>>,
    max: usize,
}

impl StdinLines {
    pub fn new(max: usize) -> StdinLines {
        StdinLines { input: BufReader::with_capacity(1 << 16, io::stdin().lock()), max }
    }

    /// The next batch of lines, without their newlines; empty at the end of input.
    pub fn next_batch(&mut self, batch: &mut Vec<Vec<u8>>) -> io::Result<()> {
        batch.clear();
        loop {
            let mut line = Vec::new();
            if self.input.read_until(b'\n', &mut line)? == 0 {
                return Ok(());
            }
            if line.last() == Some(&b'\n') {
                line.pop();
            }
            batch.push(line);
            if self.input.buffer().is_empty() || batch.len() >= self.max {
                return Ok(());
            }
        }
    }
}
