//! The store file's place. While a process uses a store, the path the config names must keep
//! naming the file it opened, and no second process may start a store at that path. Otherwise a
//! directory removed or moved, or a file replaced, under a running fencegate leaves it fsyncing
//! advances into a file that no later start reads, while a second process starts on the path as
//! a fresh store: two gates, two fences, and an older token committed after a newer one.
//!
//! The claim is an exclusive `flock` on a lock file beside the store directory (in its parent,
//! `<dir>.lock`, mode 0600): the kernel releases it when the process ends, however it ends, it
//! holds across network namespaces (two containers sharing a volume), and it outlives the store
//! directory, so a second process finds it held even after the directory was removed. The
//! identity is the store file's device and inode, compared with what the path names now before
//! every commit.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Where the store file is, claimed for this process.
pub struct Place {
    file: PathBuf,
    /// The device and inode of the file opened.
    identity: (u64, u64),
    /// Locked while the store is open: a second claim of the same directory fails.
    _claim: File,
}

#[derive(Debug, thiserror::Error)]
pub enum PlaceError {
    #[error(
        "another fencegate process uses the fence store in {dir} (its files may have been removed or moved \
         under it); stop it first"
    )]
    Claimed { dir: PathBuf },
    #[error("cannot claim the fence store in {dir}")]
    Claim { dir: PathBuf, source: std::io::Error },
    #[error(
        "the fence store file {file} is no longer the one this process opened (removed, moved or replaced): \
         refusing every change; restore it, then restart fencegate"
    )]
    Lost { file: PathBuf },
}

impl Place {
    /// Claims the store directory `dir` (which exists) for this process, before its file is
    /// opened.
    pub fn claim(dir: &Path) -> Result<Claimed, PlaceError> {
        let canonical = dir.canonicalize().map_err(|source| PlaceError::Claim { dir: dir.into(), source })?;
        let name = canonical.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let lock_path = canonical.with_file_name(format!("{name}.lock"));
        let claim_error = |source| PlaceError::Claim { dir: canonical.clone(), source };
        let lock = OpenOptions::new().create(true).append(true).mode(0o600).open(&lock_path).map_err(claim_error)?;
        // A lock file another user made could be held by them for good: only the store's owner's.
        let owner = |path: &Path| std::fs::metadata(path).map(|m| m.uid()).map_err(claim_error);
        if owner(&lock_path)? != owner(&canonical)? {
            return Err(PlaceError::Claim {
                dir: canonical.clone(),
                source: std::io::Error::other(format!(
                    "{} belongs to another user than the store directory",
                    lock_path.display()
                )),
            });
        }
        match lock.try_lock() {
            Ok(()) => Ok(Claimed { lock, dir: canonical }),
            Err(std::fs::TryLockError::WouldBlock) => Err(PlaceError::Claimed { dir: canonical }),
            Err(std::fs::TryLockError::Error(source)) => Err(claim_error(source)),
        }
    }

    /// Whether `file` still names the file this process opened.
    pub fn check(&self) -> Result<(), PlaceError> {
        match std::fs::metadata(&self.file) {
            Ok(meta) if (meta.dev(), meta.ino()) == self.identity => Ok(()),
            _ => Err(PlaceError::Lost { file: self.file.clone() }),
        }
    }
}

/// A claimed directory whose file is not open yet.
pub struct Claimed {
    lock: File,
    /// The directory, canonical.
    dir: PathBuf,
}

impl Claimed {
    /// The store directory's canonical path.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The place of `file` once it is open: the identity it has now.
    pub fn opened(self, file: &Path) -> Result<Place, PlaceError> {
        let meta = std::fs::metadata(file).map_err(|_| PlaceError::Lost { file: file.into() })?;
        Ok(Place { file: file.into(), identity: (meta.dev(), meta.ino()), _claim: self.lock })
    }
}
