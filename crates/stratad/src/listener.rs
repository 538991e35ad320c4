//! The HTTP listener every front door is served on (the API, the E2B door,
//! the door's TLS listener): one accept loop with the bounds a public
//! listener needs (`[listener]`, docs/listener.md).
//!
//! - **Connection cap**: at most `max_connections` connections are served
//!   at once per listener; the next is not accepted until one ends (it
//!   waits in the kernel's backlog, then is refused by the kernel), so a
//!   flood of idle sockets cannot take every descriptor of the daemon.
//! - **Header-read timeout**: a request's head must arrive within
//!   `header_read_timeout` of the connection being ready for it — the first
//!   request and every keep-alive one — else the connection is closed
//!   (slowloris; idle keep-alive connections end the same way).
//! - **Body idle timeout**: a request body that makes no progress for
//!   `body_idle_timeout` fails the request (the handler sees a read error;
//!   an upload is abandoned). A slow but moving body is not cut.
//! - **Drain**: on shutdown the loop stops accepting, asks every open
//!   connection to end after its current request, and waits at most
//!   `drain_timeout` for them.
//!
//! What it does not bound: a response the client reads slowly (hyper
//! applies backpressure, the handler waits), a connection after an
//! `Upgrade` (it leaves hyper and the cap; the ports module bounds those),
//! and the number of connections per client address (the E2B door limits
//! failed logins per address; a per-address cap is not built).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};

use crate::duration::serde_human;
use crate::metrics::Metrics;

/// The largest `max_connections` (far beyond any descriptor limit).
const MAX_CONNECTIONS: usize = 1 << 20;

/// A TLS handshake must finish within this.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// `[listener]`: bounds of every HTTP listener (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ListenerConfig {
    /// Connections served at once, per listener (at least 1).
    pub max_connections: usize,
    /// A request's head must arrive within this (`0s`: no limit).
    #[serde(with = "serde_human")]
    pub header_read_timeout: Duration,
    /// A request body must make progress within this (`0s`: no limit).
    #[serde(with = "serde_human")]
    pub body_idle_timeout: Duration,
    /// On shutdown, open connections get this long to finish.
    #[serde(with = "serde_human")]
    pub drain_timeout: Duration,
}

impl Default for ListenerConfig {
    fn default() -> Self {
        ListenerConfig {
            max_connections: 4096,
            header_read_timeout: Duration::from_secs(30),
            body_idle_timeout: Duration::from_secs(60),
            drain_timeout: Duration::from_secs(10),
        }
    }
}

impl ListenerConfig {
    /// Checks the values that have a range.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_connections == 0 || self.max_connections > MAX_CONNECTIONS {
            return Err(format!(
                "[listener] max_connections must be in 1..={MAX_CONNECTIONS}, got {}",
                self.max_connections
            ));
        }
        Ok(())
    }
}

/// Serves `router` on `listener` (over TLS with `tls`) until `shutdown`
/// resolves, then drains (see the module docs). Every request carries its
/// peer address as `ConnectInfo<SocketAddr>`.
pub async fn serve(
    listener: TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    router: axum::Router,
    cfg: ListenerConfig,
    metrics: Option<Arc<Metrics>>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let max = cfg.max_connections.clamp(1, MAX_CONNECTIONS);
    let permits = Arc::new(Semaphore::new(max));
    let (stop_tx, stop_rx) = watch::channel(false);
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    let gauge = Gauge {
        metrics: metrics.clone(),
        name: if acceptor.is_some() { "tls" } else { "http" },
        permits: permits.clone(),
        max,
    };
    tokio::pin!(shutdown);
    let mut was_full = false;
    loop {
        let full = permits.available_permits() == 0;
        if full && !was_full {
            // Once per episode, not once per connection while it lasts.
            tracing::warn!(
                max,
                "listener: every connection slot is taken; new connections wait"
            );
            if let Some(m) = &metrics {
                m.count("listener_full");
            }
        }
        was_full = full;
        let permit = tokio::select! {
            () = &mut shutdown => break,
            p = permits.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break, // never closed
            },
        };
        let (tcp, peer) = tokio::select! {
            () = &mut shutdown => break,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "listener: accept failed");
                    drop(permit);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let _ = tcp.set_nodelay(true);
        gauge.set();
        let conn = Conn {
            router: router.clone(),
            peer,
            header_read_timeout: cfg.header_read_timeout,
            body_idle_timeout: cfg.body_idle_timeout,
            stop: stop_rx.clone(),
            metrics: metrics.clone(),
        };
        let acceptor = acceptor.clone();
        let gauge = gauge.clone();
        tokio::spawn(async move {
            conn.run(tcp, acceptor).await;
            drop(permit);
            gauge.set();
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let drained = tokio::time::timeout(cfg.drain_timeout, permits.acquire_many(max as u32)).await;
    if drained.is_err() {
        tracing::info!(
            open = max - permits.available_permits(),
            "listener: connections still open after the drain timeout"
        );
    }
    Ok(())
}

/// The open-connection gauges of one listener, set from its permits.
#[derive(Clone)]
struct Gauge {
    metrics: Option<Arc<Metrics>>,
    name: &'static str,
    permits: Arc<Semaphore>,
    max: usize,
}

impl Gauge {
    fn set(&self) {
        if let Some(m) = &self.metrics {
            let open = self.max - self.permits.available_permits();
            m.set_listener_connections(self.name, open, self.max);
        }
    }
}

/// One accepted connection.
struct Conn {
    router: axum::Router,
    peer: SocketAddr,
    header_read_timeout: Duration,
    body_idle_timeout: Duration,
    stop: watch::Receiver<bool>,
    metrics: Option<Arc<Metrics>>,
}

impl Conn {
    async fn run(self, tcp: TcpStream, tls: Option<tokio_rustls::TlsAcceptor>) {
        match tls {
            None => self.http(hyper_util::rt::TokioIo::new(tcp)).await,
            Some(acceptor) => {
                let peer = self.peer;
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(s)) => self.http(hyper_util::rt::TokioIo::new(s)).await,
                    Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                    Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                }
            }
        }
    }

    async fn http<I>(self, io: I)
    where
        I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    {
        let Conn {
            router,
            peer,
            header_read_timeout,
            body_idle_timeout,
            mut stop,
            metrics,
        } = self;
        let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
            let mut req = req.map(|b| {
                if body_idle_timeout.is_zero() {
                    axum::body::Body::new(b)
                } else {
                    axum::body::Body::new(tower_http::timeout::TimeoutBody::new(
                        body_idle_timeout,
                        b,
                    ))
                }
            });
            req.extensions_mut()
                .insert(axum::extract::ConnectInfo::<SocketAddr>(peer));
            tower::ServiceExt::oneshot(router.clone(), req)
        });
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder.timer(hyper_util::rt::TokioTimer::new());
        builder
            .header_read_timeout((!header_read_timeout.is_zero()).then_some(header_read_timeout));
        let conn = builder.serve_connection(io, svc).with_upgrades();
        tokio::pin!(conn);
        let result = tokio::select! {
            r = conn.as_mut() => r,
            () = async {
                // The guard is dropped here, not held across the drain.
                let _ = stop.wait_for(|s| *s).await.map(|_| ());
            } => {
                conn.as_mut().graceful_shutdown();
                conn.await
            }
        };
        if let Err(e) = result {
            if e.is_timeout() {
                tracing::debug!(%peer, "connection closed: no request head within the header-read timeout");
                if let Some(m) = &metrics {
                    m.count("listener_header_timeout");
                }
            } else {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use axum::routing::{get, post};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    fn router() -> axum::Router {
        axum::Router::new()
            .route("/", get(|| async { "ok" }))
            .route(
                "/slow",
                get(|| async {
                    tokio::time::sleep(Duration::from_millis(400)).await;
                    "slow"
                }),
            )
            .route(
                "/echo",
                post(|body: axum::body::Bytes| async move { body.len().to_string() }),
            )
    }

    struct Served {
        addr: SocketAddr,
        stop: Option<tokio::sync::oneshot::Sender<()>>,
        task: tokio::task::JoinHandle<std::io::Result<()>>,
    }

    async fn start(cfg: ListenerConfig) -> Served {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(serve(l, None, router(), cfg, None, async move {
            let _ = rx.await;
        }));
        Served {
            addr,
            stop: Some(tx),
            task,
        }
    }

    fn cfg(header_ms: u64, body_ms: u64, max: usize) -> ListenerConfig {
        ListenerConfig {
            max_connections: max,
            header_read_timeout: Duration::from_millis(header_ms),
            body_idle_timeout: Duration::from_millis(body_ms),
            drain_timeout: Duration::from_secs(5),
        }
    }

    /// A connection to `s` that has sent `bytes`.
    async fn send(s: &Served, bytes: &[u8]) -> TcpStream {
        let mut c = TcpStream::connect(s.addr).await.unwrap();
        c.write_all(bytes).await.unwrap();
        c
    }

    /// Reads until the peer closes or `within` passes; `(bytes, closed)`.
    async fn read_all(s: &mut TcpStream, within: Duration) -> (String, bool) {
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, s.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return (String::from_utf8_lossy(&out).into(), true),
                Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
                Err(_) => return (String::from_utf8_lossy(&out).into(), false),
            }
        }
    }

    /// Reads one response head (up to the blank line) within `within`.
    async fn response_head(s: &mut TcpStream, within: Duration) -> Option<String> {
        let mut out = Vec::new();
        let mut b = [0u8; 1];
        let deadline = Instant::now() + within;
        while !out.ends_with(b"\r\n\r\n") {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, s.read(&mut b)).await {
                Ok(Ok(1)) => out.push(b[0]),
                _ => return None,
            }
        }
        Some(String::from_utf8_lossy(&out).into())
    }

    #[tokio::test]
    async fn a_request_head_that_does_not_arrive_in_time_closes_the_connection() {
        let s = start(cfg(300, 0, 16)).await;
        // Slowloris: half a head, then nothing.
        let mut c = send(&s, b"GET / HTTP/1.1\r\nHost: x\r\n").await;
        let t0 = Instant::now();
        let (_, closed) = read_all(&mut c, Duration::from_secs(5)).await;
        assert!(closed, "still open after 5 s");
        assert!(
            t0.elapsed() >= Duration::from_millis(250),
            "{:?}",
            t0.elapsed()
        );
        // A keep-alive connection idle after its request ends the same way.
        let mut c = send(&s, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
        let head = response_head(&mut c, Duration::from_secs(5)).await.unwrap();
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        let (_, closed) = read_all(&mut c, Duration::from_secs(5)).await;
        assert!(closed, "an idle keep-alive connection stayed open");
        // A head sent at once is served as usual.
        let mut c = send(
            &s,
            b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .await;
        let (text, _) = read_all(&mut c, Duration::from_secs(5)).await;
        assert!(
            text.starts_with("HTTP/1.1 200") && text.ends_with("ok"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn a_stalled_body_fails_and_a_slow_moving_one_does_not() {
        let s = start(cfg(10_000, 400, 16)).await;
        // 100 bytes announced, 10 sent, then silence.
        let mut c = send(
            &s,
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789",
        )
        .await;
        let t0 = Instant::now();
        let head = response_head(&mut c, Duration::from_secs(5)).await;
        let waited = t0.elapsed();
        match head {
            Some(h) => assert!(!h.starts_with("HTTP/1.1 200"), "{h}"),
            None => {
                let (_, closed) = read_all(&mut c, Duration::from_millis(100)).await;
                assert!(closed, "neither an answer nor a close after {waited:?}");
            }
        }
        assert!(waited >= Duration::from_millis(350), "{waited:?}");
        // 10 bytes every 200 ms: 2 s in all, never 400 ms without progress.
        let mut c = send(
            &s,
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\nConnection: close\r\n\r\n",
        )
        .await;
        for _ in 0..10 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            c.write_all(b"0123456789").await.unwrap();
        }
        let (text, _) = read_all(&mut c, Duration::from_secs(5)).await;
        assert!(
            text.starts_with("HTTP/1.1 200") && text.ends_with("100"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn past_the_cap_a_connection_waits_for_a_slot() {
        let s = start(cfg(10_000, 0, 2)).await;
        let mut held = Vec::new();
        for _ in 0..2 {
            let mut c = send(&s, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
            assert!(response_head(&mut c, Duration::from_secs(5))
                .await
                .is_some());
            held.push(c);
        }
        // The kernel completes the handshake (backlog); nobody serves it.
        let mut third = send(&s, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(
            response_head(&mut third, Duration::from_millis(700))
                .await
                .is_none(),
            "served past the cap"
        );
        // A slot frees: it is served.
        drop(held.pop());
        let head = response_head(&mut third, Duration::from_secs(5)).await;
        assert!(head.is_some_and(|h| h.starts_with("HTTP/1.1 200")));
    }

    #[tokio::test]
    async fn shutdown_lets_a_request_in_flight_finish_and_stops_accepting() {
        let mut s = start(cfg(10_000, 0, 16)).await;
        let mut c = send(&s, b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n").await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let _ = s.stop.take().unwrap().send(());
        let (text, closed) = read_all(&mut c, Duration::from_secs(5)).await;
        assert!(
            text.starts_with("HTTP/1.1 200") && text.ends_with("slow"),
            "{text}"
        );
        assert!(closed, "the connection stayed open after its request");
        tokio::time::timeout(Duration::from_secs(5), &mut s.task)
            .await
            .expect("serve returned")
            .unwrap()
            .unwrap();
        assert!(TcpStream::connect(s.addr).await.is_err(), "still accepting");
    }

    #[test]
    fn the_cap_must_be_positive() {
        assert!(cfg(1, 1, 0).validate().is_err());
        assert!(ListenerConfig::default().validate().is_ok());
    }
}
