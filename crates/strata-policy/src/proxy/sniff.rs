//! Stage 2, sniff: what a guest's stream (or a `CONNECT` tunnel inside it)
//! starts with, read before anything acts on it.
//!
//! - [`sniff`] looks at a new stream's first bytes: a TLS ClientHello
//!   (a guest talking TLS to the proxy without `CONNECT`: intercepted when
//!   its SNI names a connector host, see [`super::intercept`], else closed)
//!   or anything else, handed on to the
//!   HTTP stage with the bytes put back ([`Rewind`]).
//! - [`HeadCheck`] keeps a copy of the first request head as hyper reads it,
//!   for the raw-byte framing checks ([`raw_head_check`]) hyper does not make.
//! - [`client_hello`] reads the first bytes of a `CONNECT` tunnel: a TLS
//!   ClientHello must carry an SNI naming the `CONNECT` host (a host given
//!   as an IP literal has no name to send), and on the connector's TLS
//!   ports (`tls_ports`, default 443) anything but TLS is cut.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};

use crate::policy::parse_ip_literal;
use crate::sni::client_hello_sni;

/// Writes of a read-side wrapper go straight to its `inner` stream.
macro_rules! write_through {
    ($t:ident) => {
        impl<S: AsyncWrite + Unpin> AsyncWrite for $t<S> {
            fn poll_write(
                mut self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &[u8],
            ) -> Poll<io::Result<usize>> {
                Pin::new(&mut self.inner).poll_write(cx, buf)
            }
            fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                Pin::new(&mut self.inner).poll_flush(cx)
            }
            fn poll_shutdown(
                mut self: Pin<&mut Self>,
                cx: &mut Context<'_>,
            ) -> Poll<io::Result<()>> {
                Pin::new(&mut self.inner).poll_shutdown(cx)
            }
        }
    };
}

/// Largest ClientHello read before deciding.
const MAX_HELLO: usize = 16 * 1024;
/// Largest request head.
pub(super) const MAX_HEAD: usize = 64 * 1024;

/// What a stream starts with.
#[derive(Debug)]
pub enum Sniffed<S> {
    /// Not TLS: an HTTP proxy request (the stream with its first bytes put back).
    Http(Rewind<S>),
    /// A TLS ClientHello, with the SNI it names (if any), and the stream
    /// with the ClientHello put back (for interception).
    Tls {
        /// `server_name` of the ClientHello.
        sni: Option<String>,
        /// The stream, its first bytes put back.
        stream: Rewind<S>,
    },
    /// Closed, failed or silent for too long before a first byte.
    Closed,
}

/// Reads a new stream's first bytes, within `timeout`.
pub async fn sniff<S: AsyncRead + Unpin>(mut s: S, timeout: Duration) -> Sniffed<S> {
    let mut first = vec![0u8; 4096];
    let n = match tokio::time::timeout(timeout, s.read(&mut first)).await {
        Ok(Ok(n)) if n > 0 => n,
        _ => return Sniffed::Closed,
    };
    first.truncate(n);
    if first[0] != 0x16 {
        return Sniffed::Http(Rewind {
            prefix: Bytes::from(first),
            inner: s,
        });
    }
    match read_hello(&mut s, first, timeout).await {
        Some((sni, bytes)) => Sniffed::Tls {
            sni,
            stream: Rewind::new(bytes, s),
        },
        None => Sniffed::Closed,
    }
}

/// Reads on until `first` holds a whole ClientHello: its SNI and the bytes.
async fn read_hello<S: AsyncRead + Unpin>(
    s: &mut S,
    mut first: Vec<u8>,
    timeout: Duration,
) -> Option<(Option<String>, Vec<u8>)> {
    let mut chunk = [0u8; 4096];
    loop {
        match client_hello_sni(&first) {
            Some(sni) => return Some((sni, first)),
            // A record still arriving: read on (a fragmented ClientHello
            // must not slip past the check).
            None if first.len() < MAX_HELLO => {}
            None => return None,
        }
        let n = match tokio::time::timeout(timeout, s.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => n,
            _ => return None,
        };
        first.extend_from_slice(&chunk[..n]);
    }
}

/// What [`client_hello`] found at the start of a `CONNECT` tunnel.
#[derive(Debug, PartialEq, Eq)]
pub enum Hello {
    /// Forward these first bytes, then splice: a ClientHello naming the
    /// `CONNECT` host (or an IP-literal host's ClientHello without SNI), or,
    /// off the TLS ports, bytes that are not TLS (host-level guarantee only).
    Pass(Vec<u8>),
    /// The ClientHello names another host (fronting): close.
    Mismatch(String),
    /// A ClientHello without SNI to a named host (fronting by whatever the
    /// server picks on a shared address): close.
    NoSni,
    /// Not TLS on a port where the connector expects TLS: close.
    NotTls,
    /// Closed, silent, or a TLS record that never completes.
    Closed,
}

/// Reads the first bytes of a `CONNECT` tunnel to `host`; `tls` says the
/// port is one of the connector's `tls_ports`.
pub async fn client_hello<S: AsyncRead + Unpin>(
    s: &mut S,
    host: &str,
    tls: bool,
    timeout: Duration,
) -> Hello {
    let mut first = vec![0u8; 4096];
    let n = match tokio::time::timeout(timeout, s.read(&mut first)).await {
        Ok(Ok(n)) if n > 0 => n,
        _ => return Hello::Closed,
    };
    first.truncate(n);
    if first[0] != 0x16 {
        return if tls {
            Hello::NotTls
        } else {
            Hello::Pass(first)
        };
    }
    match read_hello(s, first, timeout).await {
        Some((Some(sni), _)) if !sni.trim_end_matches('.').eq_ignore_ascii_case(host) => {
            Hello::Mismatch(sni)
        }
        Some((None, _)) if parse_ip_literal(host).is_none() => Hello::NoSni,
        Some((_, bytes)) => Hello::Pass(bytes),
        None => Hello::Closed,
    }
}

/// A stream whose first bytes were read already and are given again first.
#[derive(Debug)]
pub struct Rewind<S> {
    prefix: Bytes,
    inner: S,
}

impl<S> Rewind<S> {
    /// `inner`, with `prefix` read first.
    pub fn new(prefix: impl Into<Bytes>, inner: S) -> Self {
        Rewind {
            prefix: prefix.into(),
            inner,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Rewind<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            let head = self.prefix.split_to(n);
            buf.put_slice(&head);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

write_through!(Rewind);

/// Raw-head checks, made on the bytes before hyper normalises them (hyper
/// silently collapses identical duplicate `Content-Length`s and drops
/// `Content-Length` when `Transfer-Encoding` is present).
pub(super) fn raw_head_check(head: &[u8]) -> Result<(), &'static str> {
    let mut headers = [httparse::EMPTY_HEADER; 128];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(head) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Err("request head too large"),
        Err(_) => return Err("malformed request head (obsolete line folding, bad characters)"),
    }
    let count = |name: &str| {
        req.headers
            .iter()
            .filter(|h| h.name.eq_ignore_ascii_case(name))
            .count()
    };
    let (cl, te) = (count("content-length"), count("transfer-encoding"));
    if cl > 1 {
        return Err("more than one Content-Length");
    }
    if te > 1 {
        return Err("more than one Transfer-Encoding");
    }
    if cl > 0 && te > 0 {
        return Err("Transfer-Encoding together with Content-Length");
    }
    if count("host") > 1 {
        return Err("more than one Host");
    }
    Ok(())
}

/// The verdict of [`raw_head_check`] on the first request head, once seen.
pub(super) type HeadVerdict = Arc<Mutex<Option<Result<(), &'static str>>>>;

/// Passes bytes through to hyper unchanged while keeping a copy of the
/// first request head (connections serve one request each) for
/// [`raw_head_check`].
pub(super) struct HeadCheck<S> {
    inner: S,
    head: Vec<u8>,
    done: bool,
    verdict: HeadVerdict,
}

impl<S> HeadCheck<S> {
    /// Wraps `inner`; the verdict lands in the returned slot.
    pub(super) fn new(inner: S) -> (Self, HeadVerdict) {
        let verdict = HeadVerdict::default();
        (
            HeadCheck {
                inner,
                head: Vec::new(),
                done: false,
                verdict: verdict.clone(),
            },
            verdict,
        )
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for HeadCheck<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        let r = Pin::new(&mut this.inner).poll_read(cx, buf);
        if !this.done {
            if let Poll::Ready(Ok(())) = &r {
                let new = &buf.filled()[before..];
                let start = this.head.len().saturating_sub(3);
                this.head.extend_from_slice(new);
                let end = this.head[start..]
                    .windows(4)
                    .position(|w| w == b"\r\n\r\n")
                    .map(|i| start + i + 4);
                let verdict = match end {
                    Some(end) => Some(raw_head_check(&this.head[..end])),
                    None if this.head.len() > MAX_HEAD => Some(Err("request head too large")),
                    None => None,
                };
                if let Some(v) = verdict {
                    *this.verdict.lock().unwrap_or_else(|e| e.into_inner()) = Some(v);
                    this.done = true;
                    this.head = Vec::new();
                }
            }
        }
        r
    }
}

write_through!(HeadCheck);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sni::fake_client_hello;
    use tokio::io::AsyncWriteExt;

    #[tokio::test]
    async fn http_is_rewound_and_tls_is_recognised() {
        let (mut a, b) = tokio::io::duplex(1024);
        a.write_all(b"GET http://x.test/ HTTP/1.1\r\n\r\n")
            .await
            .unwrap();
        let Sniffed::Http(mut r) = sniff(b, Duration::from_secs(1)).await else {
            panic!("not http")
        };
        let mut got = vec![0u8; 16];
        r.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"GET http://x.tes");

        let (mut a, b) = tokio::io::duplex(1 << 16);
        let hello = fake_client_hello(Some("api.test"));
        // Fragmented: the first write is only part of the record.
        a.write_all(&hello[..10]).await.unwrap();
        let t = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            a.write_all(&hello[10..]).await.unwrap();
            a
        });
        match sniff(b, Duration::from_secs(2)).await {
            Sniffed::Tls { sni, .. } => assert_eq!(sni.as_deref(), Some("api.test")),
            other => panic!("{other:?}"),
        }
        drop(t.await.unwrap());
    }

    #[tokio::test]
    async fn silent_stream_is_closed_after_the_timeout() {
        let (_a, b) = tokio::io::duplex(1024);
        assert!(matches!(
            sniff(b, Duration::from_millis(50)).await,
            Sniffed::Closed
        ));
    }

    #[tokio::test]
    async fn connect_sni_must_name_the_host() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        a.write_all(&fake_client_hello(Some("other.test")))
            .await
            .unwrap();
        assert_eq!(
            client_hello(&mut b, "api.test", false, Duration::from_secs(1)).await,
            Hello::Mismatch("other.test".into())
        );
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        let hello = fake_client_hello(Some("API.test."));
        a.write_all(&hello).await.unwrap();
        assert_eq!(
            client_hello(&mut b, "api.test", true, Duration::from_secs(1)).await,
            Hello::Pass(hello)
        );
    }

    async fn first_bytes(bytes: &[u8], host: &str, tls: bool) -> Hello {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        a.write_all(bytes).await.unwrap();
        client_hello(&mut b, host, tls, Duration::from_secs(1)).await
    }

    #[tokio::test]
    async fn connect_needs_an_sni_and_tls_on_tls_ports() {
        let no_sni = fake_client_hello(None);
        // A named host: no SNI is refused, on any port.
        assert_eq!(first_bytes(&no_sni, "api.test", true).await, Hello::NoSni);
        assert_eq!(first_bytes(&no_sni, "api.test", false).await, Hello::NoSni);
        // An IP literal has no name to send.
        assert_eq!(
            first_bytes(&no_sni, "203.0.113.7", true).await,
            Hello::Pass(no_sni.clone())
        );
        // Plain bytes: only off the TLS ports.
        assert_eq!(first_bytes(b"ping", "api.test", true).await, Hello::NotTls);
        assert_eq!(
            first_bytes(b"ping", "api.test", false).await,
            Hello::Pass(b"ping".to_vec())
        );
    }
}
