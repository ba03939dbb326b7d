//! The store file's place. While a process uses a store, the path the config names must keep
//! naming the file it opened, and no second process may start a store at that path. Otherwise a
//! directory removed or moved, or a file replaced, under a running fencegate leaves it fsyncing
//! advances into a file that no later start reads, while a second process starts on the path as
//! a fresh store: two gates, two fences, and an older token committed after a newer one.
//!
//! The claim is an abstract Unix socket named after the store directory's canonical path: the
//! kernel releases it when the process ends, however it ends, so a crash leaves nothing to clean
//! up (a lock file in the directory would go with the directory). The identity is the file's
//! device and inode, compared with what the path names now before every commit.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{SocketAddr, UnixListener};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// Where the store file is, claimed for this process.
pub struct Place {
    file: PathBuf,
    /// The device and inode of the file opened.
    identity: (u64, u64),
    /// Held while the store is open: a second claim of the same directory fails.
    _claim: UnixListener,
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
        let digest = Sha256::digest(canonical.as_os_str().as_encoded_bytes());
        let name: String = digest.iter().take(16).map(|b| format!("{b:02x}")).collect();
        let addr = SocketAddr::from_abstract_name(format!("fencegate-store-{name}"))
            .map_err(|source| PlaceError::Claim { dir: dir.into(), source })?;
        match UnixListener::bind_addr(&addr) {
            Ok(listener) => Ok(Claimed { listener }),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Err(PlaceError::Claimed { dir: canonical }),
            Err(source) => Err(PlaceError::Claim { dir: dir.into(), source }),
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
    listener: UnixListener,
}

impl Claimed {
    /// The place of `file` once it is open: the identity it has now.
    pub fn opened(self, file: &Path) -> Result<Place, PlaceError> {
        let meta = std::fs::metadata(file).map_err(|_| PlaceError::Lost { file: file.into() })?;
        Ok(Place { file: file.into(), identity: (meta.dev(), meta.ino()), _claim: self.listener })
    }
}
