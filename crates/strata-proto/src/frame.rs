//! Framing: length-prefixed frames with a 9-byte header, plus the sync marker
//! that starts every session.
//!
//! ```text
//! frame  = len:u32be kind:u8 id:u32be payload[len]      (len <= MAX_PAYLOAD)
//! sync   = SYNC_MAGIC (8 bytes, first byte 0xFF)
//! ```
//!
//! The first byte of [`SYNC_MAGIC`] is `0xFF`, so read as a length it is far
//! above [`MAX_PAYLOAD`]: at a frame boundary a sync marker can never be
//! mistaken for a frame header. A receiver that is out of sync (new
//! connection, or after a malformed frame) discards bytes until it finds the
//! marker.

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// Bytes of a frame header: length (4), kind (1), id (4).
pub const HEADER_LEN: usize = 9;
/// Largest payload a frame may carry (1 MiB).
pub const MAX_PAYLOAD: usize = 1024 * 1024;
/// Largest file-content chunk a sender puts in one frame (256 KiB).
pub const MAX_FILE_CHUNK: usize = 256 * 1024;
/// Marker that precedes the Hello (host) and the hello reply (agent).
pub const SYNC_MAGIC: [u8; 8] = [0xFF, b'S', b'T', b'R', b'A', b'T', b'A', 0x01];

/// What a frame's payload is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// JSON control message ([`crate::msg::Request`] or [`crate::msg::Response`]).
    Control = 1,
    /// Raw bytes for a command's stdin (host → agent).
    Stdin = 2,
    /// Raw bytes from a command's stdout (agent → host).
    Stdout = 3,
    /// Raw bytes from a command's stderr (agent → host).
    Stderr = 4,
    /// Raw file content (either direction, ≤ [`MAX_FILE_CHUNK`]).
    FileData = 5,
    /// Raw bytes of an egress tunnel stream (either direction, ≤
    /// [`crate::tunnel::TUNNEL_CHUNK`]); only in sessions where the host
    /// enabled egress.
    Tunnel = 6,
}

impl FrameKind {
    /// Decodes the kind byte.
    pub fn from_u8(b: u8) -> Option<Self> {
        Some(match b {
            1 => Self::Control,
            2 => Self::Stdin,
            3 => Self::Stdout,
            4 => Self::Stderr,
            5 => Self::FileData,
            6 => Self::Tunnel,
            _ => return None,
        })
    }
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Payload type.
    pub kind: FrameKind,
    /// Request/stream id: chosen by the host (high bit clear) or, for egress
    /// tunnels, by the agent (high bit set); 0 = connection-level.
    pub id: u32,
    /// Payload bytes.
    pub payload: Bytes,
}

impl Frame {
    /// A control frame carrying `msg` as JSON.
    pub fn control<T: serde::Serialize>(id: u32, msg: &T) -> Result<Self, FrameError> {
        let payload = serde_json::to_vec(msg)?;
        if payload.len() > MAX_PAYLOAD {
            return Err(FrameError::TooLarge {
                len: payload.len(),
                max: MAX_PAYLOAD,
            });
        }
        Ok(Self {
            kind: FrameKind::Control,
            id,
            payload: payload.into(),
        })
    }

    /// A data frame (caller keeps `payload` ≤ [`MAX_PAYLOAD`]).
    pub fn data(kind: FrameKind, id: u32, payload: Bytes) -> Self {
        Self { kind, id, payload }
    }

    /// Parses a control frame's JSON payload.
    pub fn parse<T: serde::de::DeserializeOwned>(&self) -> Result<T, FrameError> {
        if self.kind != FrameKind::Control {
            return Err(FrameError::UnexpectedKind(self.kind as u8));
        }
        Ok(serde_json::from_slice(&self.payload)?)
    }

    /// Encodes header + payload.
    pub fn encode(&self) -> Result<Bytes, FrameError> {
        let mut out = BytesMut::with_capacity(HEADER_LEN + self.payload.len());
        self.encode_into(&mut out)?;
        Ok(out.freeze())
    }

    /// Appends header + payload to `out`.
    pub fn encode_into(&self, out: &mut BytesMut) -> Result<(), FrameError> {
        if self.payload.len() > MAX_PAYLOAD {
            return Err(FrameError::TooLarge {
                len: self.payload.len(),
                max: MAX_PAYLOAD,
            });
        }
        out.reserve(HEADER_LEN + self.payload.len());
        // Checked above: the length fits in u32.
        out.put_u32(self.payload.len() as u32);
        out.put_u8(self.kind as u8);
        out.put_u32(self.id);
        out.put_slice(&self.payload);
        Ok(())
    }
}

/// A malformed, oversized or truncated frame, or an undecodable message.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// Declared payload length above the limit.
    #[error("frame payload of {len} bytes exceeds the maximum of {max}")]
    TooLarge {
        /// Declared length.
        len: usize,
        /// Limit.
        max: usize,
    },
    /// Unknown frame kind byte.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// A frame kind that is not allowed here.
    #[error("unexpected frame kind {0}")]
    UnexpectedKind(u8),
    /// The stream ended inside a frame.
    #[error("stream ended inside a frame ({have} of {need} bytes)")]
    Truncated {
        /// Bytes received.
        have: usize,
        /// Bytes the frame needed.
        need: usize,
    },
    /// A control payload that is not a valid message.
    #[error("invalid control message")]
    Json(#[from] serde_json::Error),
    /// A message that breaks the protocol's rules (e.g. no Hello first).
    #[error("protocol violation: {0}")]
    Violation(String),
}

/// Result of decoding one item from a byte stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decoded {
    /// A sync marker ([`SYNC_MAGIC`]) at a frame boundary.
    Sync,
    /// A complete frame.
    Frame(Frame),
}

/// Decodes one item from the start of `buf`.
///
/// Returns `Ok(None)` when more bytes are needed, `Ok(Some((item, used)))`
/// with the number of bytes consumed, or an error for a frame that can never
/// become valid. Never panics, whatever the input (fuzz-friendly).
pub fn decode_frame(buf: &[u8]) -> Result<Option<(Decoded, usize)>, FrameError> {
    if buf.is_empty() {
        return Ok(None);
    }
    if buf[0] == SYNC_MAGIC[0] {
        let n = buf.len().min(SYNC_MAGIC.len());
        if buf[..n] != SYNC_MAGIC[..n] {
            return Err(FrameError::TooLarge {
                len: usize::MAX,
                max: MAX_PAYLOAD,
            });
        }
        if n < SYNC_MAGIC.len() {
            return Ok(None);
        }
        return Ok(Some((Decoded::Sync, SYNC_MAGIC.len())));
    }
    if buf.len() < HEADER_LEN {
        return Ok(None);
    }
    let mut hdr = &buf[..HEADER_LEN];
    let len = hdr.get_u32() as usize;
    let kind_byte = hdr.get_u8();
    let id = hdr.get_u32();
    if len > MAX_PAYLOAD {
        return Err(FrameError::TooLarge {
            len,
            max: MAX_PAYLOAD,
        });
    }
    let kind = FrameKind::from_u8(kind_byte).ok_or(FrameError::UnknownKind(kind_byte))?;
    let total = HEADER_LEN + len;
    if buf.len() < total {
        return Ok(None);
    }
    let payload = Bytes::copy_from_slice(&buf[HEADER_LEN..total]);
    Ok(Some((Decoded::Frame(Frame { kind, id, payload }), total)))
}

/// Streaming decoder with sync state.
///
/// Starts out of sync: bytes before the first [`SYNC_MAGIC`] are discarded.
/// After an error it drops back out of sync, so a stream always recovers at
/// the next sync marker.
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buf: BytesMut,
    synced: bool,
    discarded: u64,
}

impl FrameDecoder {
    /// A decoder waiting for a sync marker.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends received bytes.
    pub fn extend(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// Drops all buffered bytes and waits for a sync marker again.
    pub fn reset(&mut self) {
        self.buf.clear();
        self.synced = false;
    }

    /// Whether the decoder is between a sync marker and the next error/reset.
    pub fn is_synced(&self) -> bool {
        self.synced
    }

    /// Bytes discarded while out of sync (for logs).
    pub fn discarded(&self) -> u64 {
        self.discarded
    }

    /// Bytes buffered and not yet decoded.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Whether a frame has started but not completed.
    pub fn has_partial(&self) -> bool {
        self.synced && !self.buf.is_empty()
    }

    /// Gives up on a partial frame that never completed (a stale fragment
    /// left by a previous host): drops out of sync and rescans the buffered
    /// bytes, after the fragment's first byte, for a sync marker.
    pub fn abandon_partial(&mut self) {
        if self.has_partial() {
            self.buf.advance(1);
            self.synced = false;
        }
    }

    /// Called at end of stream: an error if a frame was cut off.
    pub fn finish(&self) -> Result<(), FrameError> {
        if self.synced && !self.buf.is_empty() {
            let need = if self.buf.len() >= 4 {
                HEADER_LEN
                    + u32::from_be_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]])
                        as usize
            } else {
                HEADER_LEN
            };
            return Err(FrameError::Truncated {
                have: self.buf.len(),
                need,
            });
        }
        Ok(())
    }

    /// Next decoded item, `Ok(None)` if more bytes are needed.
    pub fn next_item(&mut self) -> Result<Option<Decoded>, FrameError> {
        if !self.synced {
            match find_magic(&self.buf) {
                Some(pos) => {
                    self.discarded += pos as u64;
                    self.buf.advance(pos + SYNC_MAGIC.len());
                    self.synced = true;
                    return Ok(Some(Decoded::Sync));
                }
                None => {
                    // Keep a tail that could be the start of a marker.
                    let keep = self.buf.len().min(SYNC_MAGIC.len() - 1);
                    let drop = self.buf.len() - keep;
                    self.discarded += drop as u64;
                    self.buf.advance(drop);
                    return Ok(None);
                }
            }
        }
        match decode_frame(&self.buf) {
            Ok(None) => Ok(None),
            Ok(Some((item, used))) => {
                self.buf.advance(used);
                Ok(Some(item))
            }
            Err(e) => {
                // Skip one byte so the resync scan does not find this spot again.
                self.buf.advance(1.min(self.buf.len()));
                self.synced = false;
                Err(e)
            }
        }
    }
}

fn find_magic(buf: &[u8]) -> Option<usize> {
    buf.windows(SYNC_MAGIC.len()).position(|w| w == SYNC_MAGIC)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn round_trip() {
        let f = Frame::data(FrameKind::Stdout, 7, Bytes::from_static(b"hello"));
        let enc = f.encode().unwrap();
        let (d, used) = decode_frame(&enc).unwrap().unwrap();
        assert_eq!(used, enc.len());
        assert_eq!(d, Decoded::Frame(f));
        // Every strict prefix needs more bytes.
        for i in 0..enc.len() {
            assert!(decode_frame(&enc[..i]).unwrap().is_none(), "prefix {i}");
        }
    }

    #[test]
    fn oversize_and_unknown_kind() {
        let mut b = BytesMut::new();
        b.put_u32((MAX_PAYLOAD + 1) as u32);
        b.put_u8(1);
        b.put_u32(1);
        assert!(matches!(decode_frame(&b), Err(FrameError::TooLarge { .. })));
        let mut b = BytesMut::new();
        b.put_u32(0);
        b.put_u8(99);
        b.put_u32(1);
        assert!(matches!(decode_frame(&b), Err(FrameError::UnknownKind(99))));
    }

    #[test]
    fn decoder_resyncs_after_garbage_and_errors() {
        let mut d = FrameDecoder::new();
        d.extend(b"stale junk from an old session");
        assert!(d.next_item().unwrap().is_none());
        d.extend(&SYNC_MAGIC);
        let f = Frame::data(FrameKind::Stdin, 1, Bytes::from_static(b"x"));
        d.extend(&f.encode().unwrap());
        assert_eq!(d.next_item().unwrap(), Some(Decoded::Sync));
        assert_eq!(d.next_item().unwrap(), Some(Decoded::Frame(f.clone())));
        // A bad header knocks the decoder out of sync ...
        d.extend(&[0, 0, 0, 1, 42, 0, 0, 0, 1, 0]);
        assert!(d.next_item().is_err());
        assert!(!d.is_synced());
        // ... and the next marker brings it back.
        d.extend(&SYNC_MAGIC);
        d.extend(&f.encode().unwrap());
        assert_eq!(d.next_item().unwrap(), Some(Decoded::Sync));
        assert_eq!(d.next_item().unwrap(), Some(Decoded::Frame(f)));
    }

    #[test]
    fn stale_partial_frame_is_abandoned() {
        let mut d = FrameDecoder::new();
        d.extend(&SYNC_MAGIC);
        assert_eq!(d.next_item().unwrap(), Some(Decoded::Sync));
        // Header of a 1000-byte frame, then a new host's marker + frame.
        d.extend(&[0, 0, 3, 232, 5, 0, 0, 0, 1]);
        d.extend(&SYNC_MAGIC);
        let f = Frame::data(FrameKind::Stdin, 2, Bytes::from_static(b"y"));
        d.extend(&f.encode().unwrap());
        assert!(d.next_item().unwrap().is_none());
        assert!(d.has_partial());
        d.abandon_partial();
        assert_eq!(d.next_item().unwrap(), Some(Decoded::Sync));
        assert_eq!(d.next_item().unwrap(), Some(Decoded::Frame(f)));
    }

    #[test]
    fn truncated_at_eof() {
        let mut d = FrameDecoder::new();
        d.extend(&SYNC_MAGIC);
        d.extend(&[0, 0, 0, 10, 1, 0, 0, 0, 1, b'{']);
        assert_eq!(d.next_item().unwrap(), Some(Decoded::Sync));
        assert!(d.next_item().unwrap().is_none());
        assert!(matches!(d.finish(), Err(FrameError::Truncated { .. })));
    }

    #[test]
    fn random_bytes_never_panic() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x5752_4154);
        for _ in 0..20_000 {
            let len = rng.gen_range(0..64);
            let mut buf: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            // Bias towards plausible headers sometimes.
            if len >= HEADER_LEN && rng.gen_bool(0.5) {
                buf[0] = 0;
                buf[1] = 0;
                buf[4] = rng.gen_range(0..8);
            }
            let _ = decode_frame(&buf);
            if let Ok(Some((Decoded::Frame(f), _))) = decode_frame(&buf) {
                let _ = f.parse::<crate::msg::Request>();
                let _ = f.parse::<crate::msg::Response>();
            }
            let mut d = FrameDecoder::new();
            d.extend(&SYNC_MAGIC);
            d.extend(&buf);
            for _ in 0..100 {
                if let Ok(None) = d.next_item() {
                    break;
                }
            }
            let _ = d.finish();
        }
    }
}
