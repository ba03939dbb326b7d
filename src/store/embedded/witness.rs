//! The store's witness: a record outside the store file of the last commit made to it, so that
//! a store that went back in time is found before it admits anything (docs/design.md section 5, G3
//! "Across restarts, restores and defaults"; `docs/design.md`, section 5).
//!
//! Every commit adds one to the store's generation (in the same transaction), then writes the
//! store's id and that generation to the witness and syncs it, before any caller of the commit
//! is answered. So the witness never trails an acknowledged commit, and a crash between the two
//! leaves the witness one commit behind, never ahead. At open:
//!
//! - store generation ≥ witness: the store has every commit the witness saw (equal, or the
//!   witness missed the last one in a crash); the witness is brought up to date;
//! - store generation < witness: an older copy was restored, or the file replaced: refused;
//! - another store id, or no store file where the witness saw one: a different or a new store
//!   where one was: refused;
//! - a store with commits but no witness: the witness was removed or left behind when the store
//!   was moved, which a restored copy would look like too: refused.
//!
//! The operator who means to go on with the store as it is says so with `fencegate init-store
//! --accept-restored`, which writes the witness anew (and makes the next start hold writes as
//! after a crash).
//!
//! The cost is one more small write and `fdatasync` per commit, after the store's own; a commit
//! carries a whole batch of advances, so it is paid per batch, not per advance.
//!
//! The file holds two slots, 4 KiB apart so that a write torn by a crash spoils at most the one
//! being written; commits alternate between them, and the valid slot with the higher
//! generation is the witness. A slot is one line of text an operator can read with `cat`.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Bytes between the two slots' starts.
const SLOT_STRIDE: u64 = 4096;
/// A slot's length: one line, padded with spaces.
const SLOT_LEN: usize = 128;
const PREFIX: &str = "fencegate store witness:";

/// What a witness says about its store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    pub store_id: u64,
    pub generation: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum WitnessError {
    #[error("cannot read or write the fence store's witness {path}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error(
        "the fence store's witness {path} belongs to another user (uid {owner}) than the store directory (uid \
         {expected}): whoever owns it could forge it; give it to the store's owner"
    )]
    Owner { path: PathBuf, owner: u32, expected: u32 },
    #[error(
        "the fence store's witness {path} is no longer the file this process writes (removed, moved or \
         replaced): refusing every change; put it back, then restart fencegate"
    )]
    Lost { path: PathBuf },
    #[error(
        "the fence store's witness {path} is not one fencegate wrote (no valid slot); move it away only if the \
         store beside it is the newest copy, then accept it with `fencegate init-store --accept-restored`"
    )]
    Unreadable { path: PathBuf },
}

/// The witness file, open for the commits of one store.
pub struct Witness {
    path: PathBuf,
    file: File,
    /// The device and inode of the file written: the path must keep naming it.
    identity: (u64, u64),
    store_id: u64,
    /// The generation written last (a commit's, or the one read at open).
    written: u64,
}

/// Opens the witness at `path` without following a symbolic link (one put there would send
/// the witness's writes elsewhere), checking that `owner` owns it.
fn open(path: &Path, options: &mut OpenOptions, owner: u32) -> Result<File, WitnessError> {
    let io = |source| WitnessError::Io { path: path.into(), source };
    let file = options.custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32).open(path).map_err(io)?;
    let found = file.metadata().map_err(io)?.uid();
    if found != owner {
        return Err(WitnessError::Owner { path: path.into(), owner: found, expected: owner });
    }
    Ok(file)
}

/// Reads the witness at `path`, which `owner` must own: `None` when there is none, or when it
/// is empty (a crash between its creation and its first write).
pub fn read(path: &Path, owner: u32) -> Result<Option<Seen>, WitnessError> {
    let file = match open(path, OpenOptions::new().read(true), owner) {
        Ok(file) => file,
        Err(WitnessError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let io = |source| WitnessError::Io { path: path.into(), source };
    if file.metadata().map_err(io)?.len() == 0 {
        return Ok(None);
    }
    let mut best: Option<Seen> = None;
    for slot in 0..2 {
        let mut line = [0u8; SLOT_LEN];
        let read = read_at_most(&file, &mut line, slot * SLOT_STRIDE).map_err(io)?;
        if let Some(seen) = parse(&line[..read]) {
            best = Some(match best {
                Some(other) if other.generation >= seen.generation => other,
                _ => seen,
            });
        }
    }
    best.map(Some).ok_or_else(|| WitnessError::Unreadable { path: path.into() })
}

impl Witness {
    /// Opens (or creates) the witness at `path` for the store `store_id`, whose last commit is
    /// `generation`, and writes that to both slots. `owner` (the store directory's) must own it.
    pub fn create(path: &Path, store_id: u64, generation: u64, owner: u32) -> Result<Self, WitnessError> {
        let io = |source| WitnessError::Io { path: path.into(), source };
        let file = open(path, OpenOptions::new().create(true).write(true).truncate(false).mode(0o600), owner)?;
        let meta = file.metadata().map_err(io)?;
        let identity = (meta.dev(), meta.ino());
        let mut witness = Self { path: path.into(), file, identity, store_id, written: 0 };
        witness.write_slot(0, generation)?;
        witness.write_slot(1, generation)?;
        witness.file.sync_all().map_err(io)?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            // The file's name is durable too: a crash right after must not lose the witness.
            File::open(dir).and_then(|d| d.sync_all()).map_err(io)?;
        }
        witness.written = generation;
        Ok(witness)
    }

    /// Records that the store's last commit is `generation`, durably, before it returns.
    pub fn record(&mut self, generation: u64) -> Result<(), WitnessError> {
        if generation <= self.written {
            return Ok(());
        }
        self.write_slot(generation % 2, generation)?;
        self.file.sync_data().map_err(|source| WitnessError::Io { path: self.path.clone(), source })?;
        self.written = generation;
        Ok(())
    }

    /// Whether the path still names the file written (before every commit, and readiness).
    pub fn check(&self) -> Result<(), WitnessError> {
        match std::fs::symlink_metadata(&self.path) {
            Ok(meta) if (meta.dev(), meta.ino()) == self.identity => Ok(()),
            _ => Err(WitnessError::Lost { path: self.path.clone() }),
        }
    }

    fn write_slot(&self, slot: u64, generation: u64) -> Result<(), WitnessError> {
        let line = render(Seen { store_id: self.store_id, generation });
        self.file
            .write_all_at(&line, slot * SLOT_STRIDE)
            .map_err(|source| WitnessError::Io { path: self.path.clone(), source })
    }
}

/// The witness's default place: beside the store directory `dir` (canonical), as
/// `<dir>.witness`, so that a copy of the directory put back is found out. On another volume
/// (`store.witness_path`) it also finds out a whole data volume restored.
pub fn default_path(canonical_dir: &Path) -> PathBuf {
    let name = canonical_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    canonical_dir.with_file_name(format!("{name}.witness"))
}

fn read_at_most(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match file.read_at(&mut buf[filled..], offset + filled as u64)? {
            0 => break,
            n => filled += n,
        }
    }
    Ok(filled)
}

/// FNV-1a, 64 bits: enough to tell a torn or foreign slot from one fencegate wrote.
fn check(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

fn body(seen: Seen) -> String {
    format!("{PREFIX} store {:016x} generation {}", seen.store_id, seen.generation)
}

fn render(seen: Seen) -> [u8; SLOT_LEN] {
    let body = body(seen);
    let text = format!("{body} check {:016x}", check(&body));
    let mut line = [b' '; SLOT_LEN];
    line[..text.len()].copy_from_slice(text.as_bytes());
    line[SLOT_LEN - 1] = b'\n';
    line
}

fn parse(line: &[u8]) -> Option<Seen> {
    let text = std::str::from_utf8(line).ok()?.trim_end();
    let (body, sum) = text.rsplit_once(" check ")?;
    if u64::from_str_radix(sum, 16).ok()? != check(body) {
        return None;
    }
    let mut words = body.strip_prefix(PREFIX)?.split_whitespace();
    let (Some("store"), Some(id), Some("generation"), Some(generation), None) =
        (words.next(), words.next(), words.next(), words.next(), words.next())
    else {
        return None;
    };
    Some(Seen { store_id: u64::from_str_radix(id, 16).ok()?, generation: generation.parse().ok()? })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_valid_slot_is_the_witness_and_a_torn_one_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w");
        let me = rustix::process::geteuid().as_raw();
        let read = |path: &Path| read(path, me);
        assert_eq!(read(&path).unwrap(), None);
        let mut witness = Witness::create(&path, 7, 3, me).unwrap();
        assert_eq!(read(&path).unwrap(), Some(Seen { store_id: 7, generation: 3 }));
        witness.record(4).unwrap();
        witness.record(5).unwrap();
        assert_eq!(read(&path).unwrap(), Some(Seen { store_id: 7, generation: 5 }));
        // Generation 6 goes to slot 0; a crash tore it half-way: slot 1 (5) is the witness.
        let mut torn = render(Seen { store_id: 7, generation: 6 });
        torn[60..].fill(0);
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().write_all_at(&torn, 0).unwrap();
        assert_eq!(read(&path).unwrap(), Some(Seen { store_id: 7, generation: 5 }));
        // A generation written earlier than the last is not written again.
        witness.record(2).unwrap();
        assert_eq!(read(&path).unwrap(), Some(Seen { store_id: 7, generation: 5 }));
    }

    #[test]
    fn a_file_with_no_valid_slot_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w");
        let me = rustix::process::geteuid().as_raw();
        std::fs::write(&path, b"fencegate store witness: store 0000000000000007 generation 9 check 0\n").unwrap();
        assert!(matches!(read(&path, me), Err(WitnessError::Unreadable { .. })));
        std::fs::write(&path, b"\n").unwrap();
        assert!(matches!(read(&path, me), Err(WitnessError::Unreadable { .. })));
        // Empty: made, then a crash before its first write; as if there were none.
        std::fs::write(&path, b"").unwrap();
        assert_eq!(read(&path, me).unwrap(), None);
        // Another user's, or a link to elsewhere: refused.
        assert!(matches!(read(&path, me + 1), Err(WitnessError::Owner { .. })));
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        assert!(matches!(read(&link, me), Err(WitnessError::Io { .. })));
    }
}
