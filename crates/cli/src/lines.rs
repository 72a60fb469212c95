//! Stdin as batches of lines: one line (blocking for it), then every whole line already
//! buffered, up to a bound. Tools that append or offer each line use it so that a fast producer
//! gets batches and a slow one gets each line at once.

use std::io::{self, BufRead, BufReader, Read, StdinLock};

pub struct Lines<R> {
    input: BufReader<R>,
    max: usize,
}

/// Stdin's lines.
pub type StdinLines = Lines<StdinLock<'static>>;

impl StdinLines {
    pub fn new(max: usize) -> StdinLines {
        Lines { input: BufReader::with_capacity(1 << 16, io::stdin().lock()), max }
    }
}

impl<R: Read> Lines<R> {
    /// The next batch of lines, without their line ends (`\n`, or `\r\n` as a file written on
    /// Windows ends them: a message is the line's text either way); empty at the end of input.
    pub fn next_batch(&mut self, batch: &mut Vec<Vec<u8>>) -> io::Result<()> {
        batch.clear();
        loop {
            let mut line = Vec::new();
            if self.input.read_until(b'\n', &mut line)? == 0 {
                return Ok(());
            }
            if line.last() == Some(&b'\n') {
                line.pop();
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
            }
            batch.push(line);
            if self.input.buffer().is_empty() || batch.len() >= self.max {
                return Ok(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_lose_their_line_ends_lf_or_crlf_and_nothing_else() {
        let text = &b"one\r\ntwo\n\r\n\rthree\r\nlast\r"[..];
        let mut lines = Lines { input: BufReader::with_capacity(4, text), max: 100 };
        let (mut all, mut batch) = (Vec::new(), Vec::new());
        loop {
            lines.next_batch(&mut batch).unwrap();
            if batch.is_empty() {
                break;
            }
            all.append(&mut batch);
        }
        let expected: [&[u8]; 5] = [b"one", b"two", b"", b"\rthree", b"last\r"];
        assert_eq!(all, expected, "a lone \\r is text; only one before \\n ends a line");
    }
}
