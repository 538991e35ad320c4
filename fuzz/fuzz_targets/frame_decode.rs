//! The host side of the agent protocol, fed bytes a hostile guest wrote.
//!
//! The input is the guest's byte stream after the host's sync marker, cut
//! into reads whose sizes come from the first input byte, as the host's
//! reader task (`client/demux.rs`) sees it: every item the streaming decoder
//! returns, every control payload parsed as a `Response`. Checked besides
//! "no panic": the decoder never holds more than one frame's worth of bytes,
//! `decode_frame` agrees with the streaming decoder on a single frame, a
//! decoded frame re-encodes to the bytes it came from, and a parsed message
//! survives a JSON round trip.
#![no_main]

use libfuzzer_sys::fuzz_target;
use strata_proto::frame::{HEADER_LEN, MAX_PAYLOAD, SYNC_MAGIC};
use strata_proto::{decode_frame, Decoded, FrameDecoder, FrameKind, Response};

fuzz_target!(|data: &[u8]| {
    let Some((&chunk_sel, stream)) = data.split_first() else {
        return;
    };
    let chunk = 1 + (chunk_sel as usize % 64) * 37;

    // One-shot decode of the stream start: never panics, consumes what it says.
    if let Ok(Some((item, used))) = decode_frame(stream) {
        assert!(used <= stream.len());
        if let Decoded::Frame(f) = &item {
            let enc = f.encode().expect("a decoded frame re-encodes");
            assert_eq!(&enc[..], &stream[..used], "re-encoding differs");
        }
    }

    let mut d = FrameDecoder::new();
    d.extend(&SYNC_MAGIC);
    let mut fed = 0;
    let mut items = 0usize;
    loop {
        match d.next_item() {
            Ok(Some(Decoded::Sync)) => items += 1,
            Ok(Some(Decoded::Frame(f))) => {
                items += 1;
                assert!(f.payload.len() <= MAX_PAYLOAD);
                if f.kind == FrameKind::Control {
                    if let Ok(r) = f.parse::<Response>() {
                        let back = serde_json::to_vec(&r).expect("a Response serializes");
                        let again: Response =
                            serde_json::from_slice(&back).expect("a serialized Response parses");
                        assert_eq!(r, again, "Response JSON round trip differs");
                    }
                }
            }
            // The host closes the connection here; keep going to exercise
            // the resync path a reconnect would use.
            Err(_) => items += 1,
            Ok(None) => {
                // Needs more bytes: at most one partial frame is buffered.
                assert!(
                    d.buffered() < HEADER_LEN + MAX_PAYLOAD.max(SYNC_MAGIC.len()),
                    "decoder buffers {} bytes",
                    d.buffered()
                );
                if fed >= stream.len() {
                    break;
                }
                let end = (fed + chunk).min(stream.len());
                d.extend(&stream[fed..end]);
                fed = end;
            }
        }
        // Every call either consumes input or asks for more: no livelock.
        assert!(
            items <= 2 * data.len() + 4,
            "decoder loops without progress"
        );
    }
    let _ = d.finish();
    if d.has_partial() {
        d.abandon_partial();
        while let Ok(Some(_)) | Err(_) = d.next_item() {
            items += 1;
            assert!(items <= 4 * data.len() + 8, "resync loops without progress");
        }
    }
});
