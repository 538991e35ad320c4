//! An exclusive `flock` on a file in the cache, so two processes building the
//! same image (two test binaries, two users) do the work once.

use std::fs::{File, OpenOptions};
use std::path::Path;

use nix::fcntl::{Flock, FlockArg};

use crate::error::ImageError;

/// Held while alive; released on drop (and by the kernel if the process dies).
pub(crate) struct Lock {
    _flock: Flock<File>,
}

impl Lock {
    /// Takes the lock on `path` (created if needed), waiting for another
    /// holder if there is one (and saying so through `log`).
    pub fn acquire(path: &Path, log: &dyn Fn(&str)) -> Result<Lock, ImageError> {
        let open = || {
            OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(path)
        };
        let file = open().map_err(ImageError::io("cannot open lock file", path))?;
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(l) => Ok(Lock { _flock: l }),
            Err((file, _)) => {
                log(&format!(
                    "waiting for another build holding {}",
                    path.display()
                ));
                let l = Flock::lock(file, FlockArg::LockExclusive).map_err(|(_, errno)| {
                    ImageError::Io {
                        what: "cannot lock",
                        path: path.to_path_buf(),
                        source: std::io::Error::from(errno),
                    }
                })?;
                Ok(Lock { _flock: l })
            }
        }
    }
}
