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
            // On while a whole line is buffered: reading a partial one would wait for its end,
            // holding back the lines taken (a slow producer gets each line at once).
            if !self.input.buffer().contains(&b'\n') || batch.len() >= self.max {
                return Ok(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A whole line is handed on while the next one is still partly read: the rest of it is not
    /// waited for (here: it would be the next read, which counts).
    #[test]
    fn a_line_is_not_held_back_by_a_partial_one_after_it() {
        struct Chunks(Vec<&'static [u8]>, usize);
        impl Read for Chunks {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                self.1 += 1;
                let Some(chunk) = self.0.first().copied() else { return Ok(0) };
                self.0.remove(0);
                buf[..chunk.len()].copy_from_slice(chunk);
                Ok(chunk.len())
            }
        }
        let mut lines = Lines { input: BufReader::new(Chunks(vec![b"a\nb", b"\n"], 0)), max: 100 };
        let mut batch = Vec::new();
        lines.next_batch(&mut batch).unwrap();
        assert_eq!(batch, [b"a".to_vec()]);
        assert_eq!(lines.input.get_ref().1, 1, "no read waited for the rest of b");
        lines.next_batch(&mut batch).unwrap();
        assert_eq!(batch, [b"b".to_vec()]);
    }

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
