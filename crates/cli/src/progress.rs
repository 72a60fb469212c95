//! Progress bars for long runs, shown only when stderr is a terminal.

use indicatif::{ProgressBar, ProgressStyle};

pub fn bar(total: u64, what: &str, unit: Unit) -> ProgressBar {
    let template = match unit {
        Unit::Bytes => "{msg:>10} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta})",
        Unit::Items => "{msg:>10} [{bar:40}] {human_pos}/{human_len} ({per_sec}, eta {eta})",
    };
    // Hidden by indicatif itself when stderr is not a terminal.
    let bar = ProgressBar::new(total);
    bar.set_style(ProgressStyle::with_template(template).expect("valid template").progress_chars("=> "));
    bar.set_message(what.to_owned());
    bar
}

#[derive(Clone, Copy)]
pub enum Unit {
    Bytes,
    Items,
}
