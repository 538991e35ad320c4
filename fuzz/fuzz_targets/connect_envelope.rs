//! The E2B door's Connect protocol decoding (an SDK client, or anyone with a
//! sandbox's envd token, sends these bodies).
//!
//! The first input byte picks how the rest is read: as a server-streaming
//! request body (envelopes) of `process.Start` / `process.Connect`, or as a
//! unary JSON body of every request type the envd handlers decode. Checked
//! besides "no panic": `decode_envelopes` accounts for every byte it
//! accepts, never returns more than the body, and re-encoding its envelopes
//! gives the body back.
#![no_main]

use libfuzzer_sys::fuzz_target;
use strata_e2b::connect::{self, decode_envelopes, envelope, FLAG_COMPRESSED, MAX_ENVELOPE};
use strata_e2b::proto;

fuzz_target!(|data: &[u8]| {
    let Some((&sel, body)) = data.split_first() else {
        return;
    };
    match decode_envelopes(body) {
        Ok(frames) => {
            let mut again = Vec::with_capacity(body.len());
            for (flags, payload) in &frames {
                assert_eq!(
                    flags & FLAG_COMPRESSED,
                    0,
                    "a compressed envelope was accepted"
                );
                assert!(payload.len() <= MAX_ENVELOPE);
                again.extend_from_slice(&envelope(*flags, payload));
            }
            assert_eq!(again, body, "envelopes do not re-encode to the body");
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
    match sel % 8 {
        0 => {
            let _ = connect::stream_request::<proto::StartRequest>(body);
        }
        1 => {
            let _ = connect::stream_request::<proto::SelectRequest>(body);
        }
        2 => {
            let _ = connect::unary_request::<proto::SendInputRequest>(body);
        }
        3 => {
            if let Ok(r) = connect::unary_request::<proto::SendSignalRequest>(body) {
                let _ = r.signal_number();
            }
        }
        4 => {
            let _ = connect::unary_request::<proto::PathRequest>(body);
        }
        5 => {
            let _ = connect::unary_request::<proto::ListDirRequest>(body);
        }
        6 => {
            let _ = connect::unary_request::<proto::MoveRequest>(body);
        }
        _ => {
            let _ = connect::unary_request::<serde_json::Value>(body);
            if let Ok(s) = std::str::from_utf8(body) {
                let _ = proto::decode_b64(s);
            }
        }
    }
});
