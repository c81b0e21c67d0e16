//! The ranks' output: each line of a rank's stdout and stderr is copied to the launcher's,
//! after the rank's prefix, one whole line at a time. When the launcher's stderr is a
//! terminal, rank 0 gets that terminal as its own stderr instead (its stdout stays piped and
//! prefixed), so that it can draw a progress bar as a single-rank run does.

use std::io::{BufRead, BufReader, IsTerminal, Read, Write};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::spawn::Stderr;

/// Where the stderr of global rank `rank` goes: the launcher's terminal for rank 0 when it is
/// shown and the launcher's stderr is a terminal, a pipe otherwise.
pub(crate) fn stderr_for(rank: usize, shown: bool, launcher_stderr_is_terminal: bool) -> Stderr {
    if rank == 0 && shown && launcher_stderr_is_terminal {
        Stderr::Inherited
    } else {
        Stderr::Piped
    }
}

/// Whether this process's stderr is a terminal.
pub(crate) fn stderr_is_terminal() -> bool {
    std::io::stderr().is_terminal()
}

/// Which of the launcher's streams a pump writes to.
#[derive(Clone, Copy)]
pub(crate) enum Stream {
    Out,
    Err,
}

/// Copies lines from `src` to the launcher's `to` after `prefix` (drops them when `!show`),
/// holding `lock` per line so that lines of different ranks never interleave.
pub(crate) fn pump(
    src: impl Read + Send + 'static,
    prefix: String,
    show: bool,
    to: Stream,
    lock: Arc<Mutex<()>>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(src);
        // The prefix and the line go out in one write: stderr is unbuffered, and rank 0 may
        // write to the same terminal directly, so a prefix written on its own could end up on
        // a line of rank 0's (the lock only orders the pumps among themselves).
        let mut line = prefix.into_bytes();
        let start = line.len();
        loop {
            line.truncate(start);
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) if !show => {}
                Ok(_) => {
                    if !line.ends_with(b"\n") {
                        line.push(b'\n');
                    }
                    let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
                    let res = match to {
                        Stream::Err => std::io::stderr().lock().write_all(&line),
                        Stream::Out => {
                            let mut o = std::io::stdout().lock();
                            o.write_all(&line).and_then(|_| o.flush())
                        }
                    };
                    if res.is_err() {
                        return;
                    }
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_shown_rank_0_gets_the_terminal_and_only_when_there_is_one() {
        assert_eq!(stderr_for(0, true, true), Stderr::Inherited);
        assert_eq!(stderr_for(0, true, false), Stderr::Piped);
        assert_eq!(stderr_for(0, false, true), Stderr::Piped);
        assert_eq!(stderr_for(1, true, true), Stderr::Piped);
    }
}
