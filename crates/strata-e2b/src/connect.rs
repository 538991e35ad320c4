//! The Connect protocol (connectrpc.com) with the JSON codec, as envd speaks it.
//!
//! - Unary: `POST /{pkg.Service}/{Method}`, request and response are bare
//!   JSON (`Content-Type: application/json`); an error is a non-2xx status
//!   with `{"code":"not_found","message":"…"}`.
//! - Server streaming: request and response bodies are sequences of
//!   envelopes (1 flag byte, 4-byte big-endian length, payload); response
//!   `Content-Type` is exactly `application/connect+json`; the last envelope
//!   has flag `0x02` (end of stream) and carries `{}` or `{"error":{…}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::{BufMut, Bytes, BytesMut};
use serde::Serialize;
use serde_json::json;

/// `Content-Type` of streaming responses with the JSON codec.
pub const STREAM_CONTENT_TYPE: &str = "application/connect+json";

/// Envelope flag: the payload is compressed (refused: envd clients do not compress).
pub const FLAG_COMPRESSED: u8 = 0x01;
/// Envelope flag: end of stream (the trailer message).
pub const FLAG_END_STREAM: u8 = 0x02;

/// Largest request envelope accepted.
pub const MAX_ENVELOPE: usize = 16 << 20;

/// Connect error codes (the subset strata produces).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Code {
    /// Cancelled by the caller.
    Canceled,
    /// Unknown error.
    Unknown,
    /// Bad request.
    InvalidArgument,
    /// Deadline passed.
    DeadlineExceeded,
    /// No such thing.
    NotFound,
    /// It exists already.
    AlreadyExists,
    /// Not allowed.
    PermissionDenied,
    /// Quota or rate.
    ResourceExhausted,
    /// Not in a state that allows it.
    FailedPrecondition,
    /// Aborted (conflict).
    Aborted,
    /// Not implemented here.
    Unimplemented,
    /// Server bug.
    Internal,
    /// Try again.
    Unavailable,
    /// No or bad credentials.
    Unauthenticated,
}

impl Code {
    /// The HTTP status of a unary error with this code (Connect spec table).
    pub fn http_status(self) -> StatusCode {
        match self {
            Code::Canceled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            Code::Unknown | Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Code::InvalidArgument | Code::FailedPrecondition => StatusCode::BAD_REQUEST,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }
}

/// A Connect error: a code and a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct ConnectError {
    /// The code.
    pub code: Code,
    /// Human message.
    pub message: String,
}

impl ConnectError {
    /// An error with this code and message.
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        ConnectError {
            code,
            message: message.into(),
        }
    }

    /// The JSON error object.
    pub fn to_json(&self) -> serde_json::Value {
        json!({ "code": self.code, "message": self.message })
    }

    /// The end-of-stream envelope carrying this error.
    pub fn end_frame(&self) -> Bytes {
        envelope(
            FLAG_END_STREAM,
            json!({ "error": self.to_json() }).to_string().as_bytes(),
        )
    }
}

impl IntoResponse for ConnectError {
    /// A unary error response.
    fn into_response(self) -> Response {
        let mut r = (self.code.http_status(), self.to_json().to_string()).into_response();
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        r
    }
}

/// Encodes one envelope.
pub fn envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + payload.len());
    b.put_u8(flags);
    b.put_u32(payload.len() as u32);
    b.put_slice(payload);
    b.freeze()
}

/// Encodes a message envelope (flag 0) with `msg` as JSON.
pub fn message_frame<T: Serialize>(msg: &T) -> Bytes {
    let payload = serde_json::to_vec(msg).unwrap_or_else(|_| b"{}".to_vec());
    envelope(0, &payload)
}

/// The successful end-of-stream envelope (`{}`).
pub fn end_ok_frame() -> Bytes {
    envelope(FLAG_END_STREAM, b"{}")
}

/// Why a request body is not a valid envelope sequence.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvelopeError {
    /// Fewer bytes than a header or than the header announced.
    #[error("truncated envelope")]
    Truncated,
    /// Compressed payloads are not supported.
    #[error("compressed envelopes are not supported")]
    Compressed,
    /// Larger than [`MAX_ENVELOPE`].
    #[error("envelope of {0} bytes is too large")]
    TooLarge(usize),
}

/// Splits a complete body into `(flags, payload)` envelopes.
pub fn decode_envelopes(mut body: &[u8]) -> Result<Vec<(u8, Bytes)>, EnvelopeError> {
    let mut out = Vec::new();
    while !body.is_empty() {
        if body.len() < 5 {
            return Err(EnvelopeError::Truncated);
        }
        let flags = body[0];
        let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
        if len > MAX_ENVELOPE {
            return Err(EnvelopeError::TooLarge(len));
        }
        if flags & FLAG_COMPRESSED != 0 {
            return Err(EnvelopeError::Compressed);
        }
        let rest = &body[5..];
        if rest.len() < len {
            return Err(EnvelopeError::Truncated);
        }
        out.push((flags, Bytes::copy_from_slice(&rest[..len])));
        body = &rest[len..];
    }
    Ok(out)
}

/// The single request message of a server-streaming call.
pub fn stream_request<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ConnectError> {
    let frames = decode_envelopes(body)
        .map_err(|e| ConnectError::new(Code::InvalidArgument, e.to_string()))?;
    let (_, payload) = frames
        .into_iter()
        .find(|(f, _)| f & FLAG_END_STREAM == 0)
        .ok_or_else(|| ConnectError::new(Code::InvalidArgument, "no request message"))?;
    serde_json::from_slice(&payload)
        .map_err(|e| ConnectError::new(Code::InvalidArgument, format!("invalid request: {e}")))
}

/// The request message of a unary call (an empty body is the default message).
pub fn unary_request<T: serde::de::DeserializeOwned + Default>(
    body: &[u8],
) -> Result<T, ConnectError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body)
        .map_err(|e| ConnectError::new(Code::InvalidArgument, format!("invalid request: {e}")))
}

/// A unary success response.
pub fn unary_response<T: Serialize>(msg: &T) -> Response {
    let body = serde_json::to_vec(msg).unwrap_or_else(|_| b"{}".to_vec());
    let mut r = (StatusCode::OK, body).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// A streaming response over a stream of already-encoded envelopes (the
/// stream must end with an end-of-stream envelope).
pub fn stream_response<S>(frames: S) -> Response
where
    S: futures::Stream<Item = Bytes> + Send + 'static,
{
    use futures::StreamExt;
    let body = axum::body::Body::from_stream(frames.map(Ok::<_, std::convert::Infallible>));
    let mut r = (StatusCode::OK, body).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(STREAM_CONTENT_TYPE),
    );
    r
}

/// Longest `Connect-Timeout-Ms` honoured (a day).
const MAX_CONNECT_TIMEOUT_MS: u64 = 24 * 3600 * 1000;

/// The deadline a Connect client asked for (`Connect-Timeout-Ms`, the
/// protocol's header; the SDKs send a command's `timeout` as it), if any.
pub fn connect_timeout(headers: &axum::http::HeaderMap) -> Option<std::time::Duration> {
    headers
        .get("connect-timeout-ms")?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()
        .filter(|&ms| ms > 0)
        .map(|ms| std::time::Duration::from_millis(ms.min(MAX_CONNECT_TIMEOUT_MS)))
}

/// `frames` until `deadline` (from now) passes: then the stream ends with a
/// `deadline_exceeded` error trailer, as a Connect server ends a call past
/// its deadline (the process it followed keeps running; only the call
/// ends). Without a deadline, `frames` as they are.
pub fn until_deadline<S>(
    frames: S,
    deadline: Option<std::time::Duration>,
) -> futures::stream::BoxStream<'static, Bytes>
where
    S: futures::Stream<Item = Bytes> + Send + 'static,
{
    use futures::StreamExt;
    let Some(d) = deadline else {
        return frames.boxed();
    };
    let fired = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let f2 = fired.clone();
    let timer = async move {
        tokio::time::sleep(d).await;
        f2.store(true, std::sync::atomic::Ordering::SeqCst);
    };
    let tail = futures::stream::once(async move {
        fired.load(std::sync::atomic::Ordering::SeqCst).then(|| {
            ConnectError::new(
                Code::DeadlineExceeded,
                format!("the call's deadline of {} ms passed", d.as_millis()),
            )
            .end_frame()
        })
    })
    .filter_map(futures::future::ready);
    frames.take_until(Box::pin(timer)).chain(tail).boxed()
}

/// A streaming response that is only an error trailer.
pub fn stream_error(err: ConnectError) -> Response {
    stream_response(futures::stream::iter([err.end_frame()]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_round_trip() {
        let a = envelope(0, br#"{"a":1}"#);
        assert_eq!(&a[..5], &[0, 0, 0, 0, 7]);
        let b = end_ok_frame();
        let mut body = a.to_vec();
        body.extend_from_slice(&b);
        let frames = decode_envelopes(&body).unwrap();
        assert_eq!(frames.len(), 2);
        assert_eq!(frames[0], (0, Bytes::from_static(br#"{"a":1}"#)));
        assert_eq!(frames[1], (FLAG_END_STREAM, Bytes::from_static(b"{}")));
    }

    #[test]
    fn truncated_and_compressed_envelopes_are_refused() {
        assert_eq!(decode_envelopes(&[0, 0, 0]), Err(EnvelopeError::Truncated));
        assert_eq!(
            decode_envelopes(&[0, 0, 0, 0, 5, b'{']),
            Err(EnvelopeError::Truncated)
        );
        assert_eq!(
            decode_envelopes(&[1, 0, 0, 0, 0]),
            Err(EnvelopeError::Compressed)
        );
        assert_eq!(
            decode_envelopes(&[0, 0xff, 0, 0, 0]),
            Err(EnvelopeError::TooLarge(0xff00_0000))
        );
    }

    #[test]
    fn error_trailer_is_connect_json() {
        let f = ConnectError::new(Code::NotFound, "no such process").end_frame();
        assert_eq!(f[0], FLAG_END_STREAM);
        let v: serde_json::Value = serde_json::from_slice(&f[5..]).unwrap();
        assert_eq!(
            v,
            json!({"error": {"code": "not_found", "message": "no such process"}})
        );
        assert_eq!(
            u32::from_be_bytes([f[1], f[2], f[3], f[4]]) as usize,
            f.len() - 5
        );
    }

    #[tokio::test]
    async fn a_stream_past_its_deadline_ends_with_deadline_exceeded() {
        use futures::StreamExt;
        let mut h = axum::http::HeaderMap::new();
        h.insert("connect-timeout-ms", HeaderValue::from_static("50"));
        let d = connect_timeout(&h);
        assert_eq!(d, Some(std::time::Duration::from_millis(50)));
        // A stream that never ends by itself: one frame, then silence.
        let frames =
            futures::stream::iter([Bytes::from_static(b"a")]).chain(futures::stream::pending());
        let t = std::time::Instant::now();
        let got: Vec<Bytes> = until_deadline(frames, d).collect().await;
        assert!(t.elapsed() >= std::time::Duration::from_millis(50));
        assert_eq!(got.len(), 2, "{got:?}");
        let (flags, payload) = decode_envelopes(&got[1]).unwrap().remove(0);
        assert_eq!(flags & 0x02, 0x02, "an end-of-stream envelope");
        let v: serde_json::Value = serde_json::from_slice(&payload).unwrap();
        assert_eq!(v["error"]["code"], "deadline_exceeded", "{v}");
        // A stream that ends first is untouched; bad headers are no deadline.
        let ended: Vec<Bytes> = until_deadline(futures::stream::iter([end_ok_frame()]), d)
            .collect()
            .await;
        assert_eq!(ended, vec![end_ok_frame()]);
        for bad in ["0", "-5", "x", ""] {
            h.insert("connect-timeout-ms", HeaderValue::from_str(bad).unwrap());
            assert_eq!(connect_timeout(&h), None, "{bad:?}");
        }
    }

    #[test]
    fn stream_request_takes_the_first_message() {
        #[derive(serde::Deserialize, Debug, PartialEq)]
        struct M {
            x: u32,
        }
        let mut body = envelope(0, br#"{"x":3}"#).to_vec();
        body.extend_from_slice(&end_ok_frame());
        assert_eq!(stream_request::<M>(&body).unwrap(), M { x: 3 });
        let e = stream_request::<M>(&end_ok_frame()).unwrap_err();
        assert_eq!(e.code, Code::InvalidArgument);
    }

    #[test]
    fn unary_status_codes() {
        assert_eq!(Code::NotFound.http_status(), StatusCode::NOT_FOUND);
        assert_eq!(
            Code::Unauthenticated.http_status(),
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(Code::AlreadyExists.http_status(), StatusCode::CONFLICT);
        assert_eq!(Code::Canceled.http_status().as_u16(), 499);
    }
}
