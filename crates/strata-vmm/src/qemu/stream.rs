//! The few parts of QEMU's migration stream (format version 3) that the
//! direct device-state save ([`crate::SaveMethod::Direct`]) rewrites.
//!
//! A `migrate` file is: magic `QEVM`, version 3, the `configuration`
//! section (machine name and the validated capabilities), the RAM module's
//! sections, every device's FULL section, `EOF`, then a JSON description
//! (`vmdesc`). `xen-save-devices-state` writes magic, version, the same FULL
//! sections and `EOF`, nothing else, and its `globalstate` section says
//! `running` whatever the VM's state. To make it a file `migrate-incoming`
//! loads like a `migrate` file, the direct save puts this VM's own
//! configuration (captured from its first `migrate` save by
//! [`configuration`]) after the header, says `paused` in `globalstate`
//! ([`paused_globalstate`]) and appends an empty description ([`VMDESC`]).
//!
//! Anything not exactly as expected is an [`StreamError`]: the caller then
//! keeps using `migrate` for that VM.

use std::fmt;

/// `QEVM`, then stream version 3 (big endian), as QEMU 2.x-9.x write them.
pub const HEADER: [u8; 8] = *b"QEVM\0\0\0\x03";

/// An empty JSON description (`vmdesc` section): `{}`. QEMU's loader reads
/// and skips it (without it, it logs "Expected vmdescription section").
pub const VMDESC: [u8; 7] = [0x06, 0, 0, 0, 2, b'{', b'}'];

const CONFIGURATION: u8 = 0x07;
const SUBSECTION: u8 = 0x05;
const SECTION_FULL: u8 = 0x04;
const SECTION_FOOTER: u8 = 0x7e;
const EOF: u8 = 0x00;
const GLOBALSTATE: &[u8] = b"globalstate";
/// `globalstate`'s run-state buffer (`uint8_t runstate[100]`).
const RUNSTATE_LEN: usize = 100;

/// How a stream is not what this module understands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamError(pub String);

impl fmt::Display for StreamError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for StreamError {}

fn err<T>(why: impl Into<String>) -> Result<T, StreamError> {
    Err(StreamError(why.into()))
}

/// A cursor over the head of a stream.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], StreamError> {
        let end = self.at.checked_add(n).filter(|e| *e <= self.b.len());
        let Some(end) = end else {
            return err(format!(
                "stream ends inside the configuration (at byte {})",
                self.at
            ));
        };
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, StreamError> {
        Ok(self.take(1)?[0])
    }
    fn be32(&mut self) -> Result<u32, StreamError> {
        let s = self.take(4)?;
        Ok(u32::from_be_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn peek(&self) -> Option<u8> {
        self.b.get(self.at).copied()
    }
}

/// The `configuration` section of a `migrate` file's head (its bytes
/// after the 8-byte header, up to the first section that follows it).
/// Known subsections only: `capabilities` (a count and names),
/// `target-page-bits` (one be32) and `uuid` (16 bytes); anything else is
/// an error, so nothing is copied that was not understood.
pub fn configuration(head: &[u8]) -> Result<Vec<u8>, StreamError> {
    if head.len() < HEADER.len() || head[..HEADER.len()] != HEADER {
        return err("not a version 3 QEVM stream");
    }
    let mut r = Reader {
        b: head,
        at: HEADER.len(),
    };
    if r.u8()? != CONFIGURATION {
        return err("no configuration section after the header");
    }
    let len = r.be32()? as usize;
    if len == 0 || len > 256 {
        return err(format!("machine name of {len} bytes"));
    }
    if !r.take(len)?.iter().all(|c| c.is_ascii_graphic()) {
        return err("machine name is not printable");
    }
    while r.peek() == Some(SUBSECTION) {
        r.u8()?;
        let len = r.u8()? as usize;
        let name = r.take(len)?.to_vec();
        let _version = r.be32()?;
        match name.as_slice() {
            b"configuration/capabilities" => {
                let count = r.be32()?;
                if count > 64 {
                    return err(format!("{count} capabilities"));
                }
                for _ in 0..count {
                    let len = r.u8()? as usize;
                    r.take(len)?;
                }
            }
            b"configuration/target-page-bits" => {
                r.be32()?;
            }
            b"configuration/uuid" => {
                r.take(16)?;
            }
            other => {
                return err(format!(
                    "unknown configuration subsection {:?}",
                    String::from_utf8_lossy(other)
                ))
            }
        }
    }
    // What follows must be a section (the RAM module's start, or a device's).
    match r.peek() {
        Some(0x01..=0x04) => Ok(head[HEADER.len()..r.at].to_vec()),
        Some(t) => err(format!("byte {t:#04x} after the configuration")),
        None => err("stream ends after the configuration"),
    }
}

/// Where, in `tail` (the last bytes of an `xen-save-devices-state`
/// stream, ending at its `EOF`), the 12 bytes of `globalstate`'s size and
/// run state start, and the bytes that say `paused` there. The section
/// must be the last one, as QEMU 7.2 registers it, say `running` and be
/// framed exactly as expected (header, size, 100-byte buffer, footer with
/// the same section id, `EOF`).
pub fn paused_globalstate(tail: &[u8]) -> Result<(usize, [u8; 12]), StreamError> {
    // 0x04, id, len, name, instance, version | size, buffer | 0x7e, id | EOF
    let section = 1 + 4 + 1 + GLOBALSTATE.len() + 4 + 4 + 4 + RUNSTATE_LEN + 1 + 4 + 1;
    if tail.len() < section {
        return err("stream shorter than its globalstate section");
    }
    let s = &tail[tail.len() - section..];
    let be32 = |at: usize| u32::from_be_bytes([s[at], s[at + 1], s[at + 2], s[at + 3]]);
    let name_at = 6;
    let fields = name_at + GLOBALSTATE.len() + 8;
    let footer = fields + 4 + RUNSTATE_LEN;
    let framed = s[0] == SECTION_FULL
        && s[5] as usize == GLOBALSTATE.len()
        && &s[name_at..name_at + GLOBALSTATE.len()] == GLOBALSTATE
        && s[footer] == SECTION_FOOTER
        && be32(1) == be32(footer + 1)
        && s[section - 1] == EOF;
    if !framed {
        return err("the stream does not end with the globalstate section");
    }
    let running = b"running\0";
    if be32(fields) as usize != running.len()
        || &s[fields + 4..fields + 4 + running.len()] != running
        || s[fields + 4 + running.len()..footer]
            .iter()
            .any(|b| *b != 0)
    {
        return err("globalstate does not say running");
    }
    // As `migrate` writes a stopped VM's: size strlen + 1, zero padded.
    let mut paused = [0u8; 12];
    paused[..4].copy_from_slice(&7u32.to_be_bytes());
    paused[4..10].copy_from_slice(b"paused");
    Ok((tail.len() - section + fields, paused))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The head of a real `migrate` file of a strata VM (QEMU 7.2,
    /// `x-ignore-shared` on), then the RAM module's section start.
    const HEAD: &str = "5145564d0000000307000000076d6963726f766d051a636f6e66696775726174696f6e2f6361706162696c697469657300000001000000010f782d69676e6f72652d736861726564010000000203";

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap_or(0))
            .collect()
    }

    #[test]
    fn the_configuration_of_a_real_stream() {
        let head = hex(HEAD);
        let cfg = configuration(&head).expect("parsed");
        assert_eq!(cfg.len(), 0x48 - 8);
        assert_eq!(&cfg[..], &head[8..0x48]);
        // Cut short, a foreign subsection, an unknown byte after it: refused.
        assert!(configuration(&head[..40]).is_err());
        let mut other = head.clone();
        other[0x16..0x16 + 26].copy_from_slice(b"configuration/somethingnew");
        assert!(configuration(&other).is_err());
        let mut after = head.clone();
        after[0x48] = 0x09;
        assert!(configuration(&after).is_err());
        assert!(configuration(b"QEVM\0\0\0\x02").is_err());
    }

    fn globalstate(run: &str, id: u8) -> Vec<u8> {
        let mut s = vec![0xaa; 20]; // the end of the section before
        s.extend([SECTION_FULL, 0, 0, 0, 0x15, 11]);
        s.extend(GLOBALSTATE);
        s.extend([0, 0, 0, 0, 0, 0, 0, 1]);
        s.extend((run.len() as u32 + 1).to_be_bytes());
        let mut buf = run.as_bytes().to_vec();
        buf.resize(RUNSTATE_LEN, 0);
        s.extend(buf);
        s.extend([SECTION_FOOTER, 0, 0, 0, id, EOF]);
        s
    }

    #[test]
    fn globalstate_running_becomes_paused_as_migrate_writes_it() {
        let mut tail = globalstate("running", 0x15);
        let (at, bytes) = paused_globalstate(&tail).expect("found");
        tail[at..at + 12].copy_from_slice(&bytes);
        assert_eq!(tail, globalstate("paused", 0x15));
        // Already paused, another footer id, a byte after EOF: refused.
        assert!(paused_globalstate(&globalstate("paused", 0x15)).is_err());
        assert!(paused_globalstate(&globalstate("running", 0x16)).is_err());
        let mut longer = globalstate("running", 0x15);
        longer.push(0);
        assert!(paused_globalstate(&longer).is_err());
        assert!(paused_globalstate(&[0; 10]).is_err());
    }
}
