//! The ranks' output: each line of a rank's stdout and stderr is copied to the launcher's,
//! after the rank's prefix, one whole line at a time, by one thread for all the ranks
//! ([`Pumps`]). When the launcher's stderr is a
//! terminal, rank 0 gets that terminal as its own stderr instead (its stdout stays piped and
//! prefixed), so that it can draw a progress bar as a single-rank run does.

use std::io::{IsTerminal, Read, Write};
use std::os::fd::AsRawFd;
use std::sync::mpsc;
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

/// Which of the launcher's streams a rank's pipe is copied to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stream {
    Out,
    Err,
}

/// Where the copied lines go: the launcher's stdout and stderr, or a test's buffer.
pub(crate) type Sink = Box<dyn FnMut(Stream, &[u8]) -> std::io::Result<()> + Send>;

/// The launcher's own streams.
pub(crate) fn launcher_streams() -> Sink {
    Box::new(|to, line| match to {
        Stream::Err => std::io::stderr().lock().write_all(line),
        Stream::Out => {
            let mut o = std::io::stdout().lock();
            o.write_all(line).and_then(|_| o.flush())
        }
    })
}

/// A rank's pipe, as the pump reads it.
pub(crate) trait Pipe: Read + AsRawFd + Send {}
impl<T: Read + AsRawFd + Send> Pipe for T {}

/// One pipe being copied.
struct Source {
    pipe: Box<dyn Pipe>,
    /// The rank's prefix; the line being read follows it.
    line: Vec<u8>,
    prefix_len: usize,
    show: bool,
    to: Stream,
}

/// Copies every rank's stdout and stderr, line by line, on one thread. A thread per pipe (two
/// per rank, as this was) makes the launcher hold 2W threads while it starts the ranks, and
/// every fork copies the address space of all of them, their stacks' mappings included: the
/// fork of rank r then costs time in proportion to r, and starting W ranks grows with W².
pub(crate) struct Pumps {
    add: mpsc::Sender<Source>,
    /// Written once per added pipe, closed by [`Pumps::finish`]: wakes the thread.
    wake: std::io::PipeWriter,
    thread: JoinHandle<()>,
}

impl Pumps {
    /// Starts the thread; it writes the lines to `sink`.
    pub(crate) fn start(sink: Sink) -> std::io::Result<Pumps> {
        let (wake_rx, wake) = std::io::pipe()?;
        let (add, sources) = mpsc::channel();
        let thread = std::thread::Builder::new().name("allgrad-output".into()).spawn(move || run(sources, wake_rx, sink))?;
        Ok(Pumps { add, wake, thread })
    }

    /// Copies lines from `pipe` to the launcher's `to` after `prefix` (drops them when `!show`).
    pub(crate) fn add(&mut self, pipe: impl Pipe + 'static, prefix: String, show: bool, to: Stream) {
        let line = prefix.into_bytes();
        let prefix_len = line.len();
        if self.add.send(Source { pipe: Box::new(pipe), line, prefix_len, show, to }).is_ok() {
            let _ = self.wake.write_all(&[1]);
        }
    }

    /// No more pipes: the thread ends once every pipe added has reached its end.
    pub(crate) fn finish(self) -> JoinHandle<()> {
        self.thread
    }
}

/// The pump thread: polls the pipes, writes every whole line, one write per line (the
/// prefix and the line together: stderr is unbuffered, and rank 0 may write to the same
/// terminal directly, so a prefix written on its own could end up on a line of rank 0's).
fn run(sources: mpsc::Receiver<Source>, mut wake: std::io::PipeReader, mut sink: Sink) {
    let mut open: Vec<Source> = Vec::new();
    let mut adding = true;
    let mut buf = vec![0u8; 64 << 10];
    let mut fds: Vec<libc::pollfd> = Vec::new();
    while adding || !open.is_empty() {
        open.extend(sources.try_iter());
        fds.clear();
        if adding {
            fds.push(libc::pollfd { fd: wake.as_raw_fd(), events: libc::POLLIN, revents: 0 });
        }
        fds.extend(open.iter().map(|s| libc::pollfd { fd: s.pipe.as_raw_fd(), events: libc::POLLIN, revents: 0 }));
        // SAFETY: `fds` is a valid array of pollfd of the given length.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if ready < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
        let mut at = 0;
        if adding {
            if fds[0].revents != 0 && matches!(wake.read(&mut buf), Ok(0) | Err(_)) {
                // Closed: every pipe was sent before it, so the channel has them all.
                adding = false;
                open.extend(sources.try_iter());
            }
            at = 1;
        }
        let mut k = 0;
        open.retain_mut(|src| {
            let revents = fds.get(at + k).map_or(0, |f| f.revents);
            k += 1;
            revents == 0 || pump_once(src, &mut buf, &mut sink)
        });
    }
}

/// Reads what `src` has (its pipe is readable or closed) and writes its whole lines; returns
/// whether the pipe stays open. At the end a last line without a newline gets one.
fn pump_once(src: &mut Source, buf: &mut [u8], sink: &mut Sink) -> bool {
    let n = match src.pipe.read(buf) {
        Ok(n) => n,
        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => return true,
        Err(_) => 0,
    };
    if n == 0 {
        if src.show && src.line.len() > src.prefix_len {
            src.line.push(b'\n');
            let _ = sink(src.to, &src.line);
        }
        return false;
    }
    if !src.show {
        return true;
    }
    let mut rest = &buf[..n];
    while let Some(i) = rest.iter().position(|b| *b == b'\n') {
        src.line.extend_from_slice(&rest[..=i]);
        rest = &rest[i + 1..];
        if sink(src.to, &src.line).is_err() {
            // The launcher's stream is gone: closing the pipe tells the rank.
            return false;
        }
        src.line.truncate(src.prefix_len);
    }
    src.line.extend_from_slice(rest);
    true
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

    /// Lines from several pipes, one of them added while the thread already waits and one
    /// hidden, come out whole, each after its prefix, in each pipe's order, a last line
    /// without a newline with one added; the thread ends once every pipe is closed.
    #[test]
    fn one_thread_copies_every_pipe_line_by_line() {
        let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::<(Stream, String)>::new()));
        let sink_got = got.clone();
        let mut pumps = Pumps::start(Box::new(move |to, line| {
            sink_got.lock().unwrap().push((to, String::from_utf8_lossy(line).into_owned()));
            Ok(())
        }))
        .unwrap();
        let (a, mut a_w) = std::io::pipe().unwrap();
        let (b, mut b_w) = std::io::pipe().unwrap();
        let (c, mut c_w) = std::io::pipe().unwrap();
        pumps.add(a, "[a] ".into(), true, Stream::Out);
        pumps.add(b, "[b] ".into(), false, Stream::Out);
        // A line written in pieces, across reads.
        a_w.write_all(b"one, ").unwrap();
        std::thread::sleep(std::time::Duration::from_millis(50));
        a_w.write_all(b"still one\ntwo\nthree without a newline").unwrap();
        b_w.write_all(b"hidden\n").unwrap();
        std::thread::sleep(std::time::Duration::from_millis(50));
        pumps.add(c, "[c] ".into(), true, Stream::Err);
        c_w.write_all(b"from c\n").unwrap();
        drop((a_w, b_w, c_w));
        let thread = pumps.finish();
        thread.join().unwrap();
        let got = got.lock().unwrap().clone();
        let of = |p: &str| got.iter().filter(|(_, l)| l.starts_with(p)).map(|(t, l)| (*t, l.as_str())).collect::<Vec<_>>();
        assert_eq!(
            of("[a]"),
            vec![
                (Stream::Out, "[a] one, still one\n"),
                (Stream::Out, "[a] two\n"),
                (Stream::Out, "[a] three without a newline\n")
            ]
        );
        assert_eq!(of("[c]"), vec![(Stream::Err, "[c] from c\n")]);
        assert_eq!(got.len(), 4, "{got:?}");
    }
}
