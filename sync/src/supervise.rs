//! Running the job's command as a supervised child: signals forwarded, exit observed.
//!
//! A forwarder thread receives the job signals (SIGTERM, SIGINT, SIGUSR1, SIGUSR2) and passes each
//! to the child at once, even while the main thread is busy syncing, so a training script gets
//! SLURM's warning in time to checkpoint. SIGINT that the kernel raised (Ctrl-C at a terminal)
//! already reached the child, which shares our process group, and is not sent a second time.
//!
//! A waiter thread learns of the child's exit with `waitid(WNOWAIT)`, marks it under the same
//! lock the forwarder holds while it calls `kill`, and only then reaps it. The pid therefore
//! cannot be recycled between the forwarder's check and its `kill`.

use signal_hook::iterator::exfiltrator::WithOrigin;
use signal_hook::iterator::{Handle, SignalsInfo};
use signal_hook::low_level::siginfo::Cause;
use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, ExitStatus};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The signals `stagefs run` forwards to its command.
pub const FORWARDED: [i32; 4] = [libc::SIGTERM, libc::SIGINT, libc::SIGUSR1, libc::SIGUSR2];

/// Something that happened to the supervised command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A job signal arrived (already forwarded to the child if it was still running).
    Signal(i32),
    /// The child exited; its shell-style status (code, or 128 + signal).
    Exited(i32),
}

/// A running command with signal forwarding.
pub struct Supervised {
    pid: u32,
    events: Receiver<Event>,
    exited: Arc<Mutex<bool>>,
    signals: Handle,
}

/// Shell-style exit status: the code, or 128 + the signal that killed the process.
pub fn shell_status(status: ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(sig)) => 128 + sig,
        (None, None) => 1,
    }
}

impl Supervised {
    /// Starts `program args...` with our environment (plus `envs`) and stdio, after installing
    /// the signal forwarder (so no signal is lost between spawn and installation).
    pub fn spawn(
        program: &OsString,
        args: &[OsString],
        envs: &[(OsString, OsString)],
    ) -> std::io::Result<Supervised> {
        let mut signals = SignalsInfo::<WithOrigin>::new(FORWARDED)?;
        let handle = signals.handle();
        let spawned = Command::new(program)
            .args(args)
            .envs(envs.iter().map(|(k, v)| (k, v)))
            .spawn();
        let child = match spawned {
            Ok(c) => c,
            Err(e) => {
                handle.close();
                return Err(e);
            }
        };
        let pid = child.id();
        let (tx, events) = mpsc::channel();
        let exited = Arc::new(Mutex::new(false));

        let fwd_tx = tx.clone();
        let fwd_exited = Arc::clone(&exited);
        std::thread::Builder::new()
            .name("stagefs-signals".into())
            .spawn(move || {
                for origin in signals.forever() {
                    let sig = origin.signal;
                    let from_tty = sig == libc::SIGINT && origin.cause == Cause::Kernel;
                    if let Ok(done) = fwd_exited.lock() {
                        if !*done && !from_tty {
                            // SAFETY: the child is not reaped while `done` is false and we hold
                            // the lock, so `pid` still names it.
                            unsafe { libc::kill(pid as libc::pid_t, sig) };
                        }
                    }
                    if fwd_tx.send(Event::Signal(sig)).is_err() {
                        break;
                    }
                }
            })?;

        let wait_exited = Arc::clone(&exited);
        std::thread::Builder::new()
            .name("stagefs-wait".into())
            .spawn(move || wait_child(child, pid, &wait_exited, &tx))?;

        Ok(Supervised {
            pid,
            events,
            exited,
            signals: handle,
        })
    }

    /// The child's process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Waits up to `timeout` for the next event.
    pub fn next_event(&self, timeout: Duration) -> Option<Event> {
        match self.events.recv_timeout(timeout) {
            Ok(ev) => Some(ev),
            Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => None,
        }
    }

    /// Waits up to `timeout` for the child to exit, ignoring further signals; returns its status.
    pub fn wait_exit(&self, timeout: Duration) -> Option<i32> {
        let end = std::time::Instant::now() + timeout;
        loop {
            let left = end.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return None;
            }
            if let Some(Event::Exited(s)) = self.next_event(left) {
                return Some(s);
            }
        }
    }

    /// Sends `sig` to the child if it is still running.
    pub fn kill(&self, sig: i32) {
        if let Ok(done) = self.exited.lock() {
            if !*done {
                // SAFETY: as in the forwarder, the child is unreaped while we hold the lock.
                unsafe { libc::kill(self.pid as libc::pid_t, sig) };
            }
        }
    }
}

impl Drop for Supervised {
    fn drop(&mut self) {
        self.signals.close();
    }
}

fn wait_child(mut child: Child, pid: u32, exited: &Mutex<bool>, tx: &mpsc::Sender<Event>) {
    loop {
        // SAFETY: siginfo_t is plain data; waitid fills it. WNOWAIT leaves the child unreaped.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: valid pid and a valid pointer to `info`.
        let rc = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOWAIT,
            )
        };
        if rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            break;
        }
    }
    if let Ok(mut done) = exited.lock() {
        *done = true;
    }
    let status = child.wait().map(shell_status).unwrap_or(1);
    let _ = tx.send(Event::Exited(status));
}
