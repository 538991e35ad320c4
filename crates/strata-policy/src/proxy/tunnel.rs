//! Stage 1, the tunnel: admitting a guest's stream under the caps.
//!
//! Every stream a guest opens (one per TCP connection to its egress
//! listener) is admitted here before anything reads it, or refused:
//!
//! - at most [`TunnelLimits::per_sandbox`] streams of one sandbox at once;
//! - at most [`TunnelLimits::host`] *units* on the host: a stream is one
//!   unit and each upstream socket it opens is one more (so the daemon's
//!   descriptors egress can use never pass the host cap, which the daemon
//!   derives from `RLIMIT_NOFILE` minus a reserve);
//! - opens of one sandbox through a token bucket ([`TunnelLimits::rate`]
//!   per second, [`TunnelLimits::burst`] at once), taken only by an open the
//!   caps would admit.
//!
//! A refusal says why ([`Refused`]); the caller turns it into
//! `tunnel_close {error}`, which closes that guest connection only.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The caps on guest streams (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TunnelLimits {
    /// Streams one sandbox may have open at once.
    pub per_sandbox: usize,
    /// Units (streams + upstream sockets) all sandboxes together may hold.
    pub host: usize,
    /// Sustained stream opens per second per sandbox (0: no rate limit).
    pub rate: f64,
    /// Opens a sandbox may make at once before the rate applies.
    pub burst: u32,
}

impl Default for TunnelLimits {
    fn default() -> Self {
        TunnelLimits {
            per_sandbox: 128,
            host: 4096,
            rate: 100.0,
            burst: 200,
        }
    }
}

/// Why a stream (or an upstream socket) was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// The sandbox has [`TunnelLimits::per_sandbox`] streams open.
    #[error("too many egress connections from this sandbox (limit {0})")]
    SandboxCap(usize),
    /// The host holds [`TunnelLimits::host`] units.
    #[error("the host's egress connections are exhausted (limit {0})")]
    HostCap(usize),
    /// The sandbox opens streams faster than its bucket refills.
    #[error("egress connections opened too fast (limit {rate}/s, burst {burst})")]
    Rate {
        /// Opens per second.
        rate: u32,
        /// Bucket size.
        burst: u32,
    },
}

/// The host's share: units in use across every sandbox.
#[derive(Debug)]
pub struct HostTunnels {
    limits: TunnelLimits,
    units: AtomicUsize,
}

impl HostTunnels {
    /// Host-wide counters under `limits` (shared by every sandbox's proxy).
    pub fn new(limits: TunnelLimits) -> Arc<Self> {
        Arc::new(HostTunnels {
            limits,
            units: AtomicUsize::new(0),
        })
    }

    /// The caps in force.
    pub fn limits(&self) -> TunnelLimits {
        self.limits
    }

    /// Units held now (streams + upstream sockets).
    pub fn units(&self) -> usize {
        self.units.load(Ordering::SeqCst)
    }

    /// One unit, if the host has one left.
    pub fn try_unit(self: &Arc<Self>) -> Result<Unit, Refused> {
        let cap = self.limits.host;
        self.units
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < cap).then_some(n + 1)
            })
            .map_err(|_| Refused::HostCap(cap))?;
        Ok(Unit(self.clone()))
    }
}

/// One host unit; given back when dropped.
#[derive(Debug)]
pub struct Unit(Arc<HostTunnels>);

impl Drop for Unit {
    fn drop(&mut self) {
        self.0.units.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A token bucket (opens per second, burst).
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// Counts of one sandbox.
#[derive(Debug, Default)]
struct Counts {
    open: AtomicUsize,
    upstream: AtomicUsize,
    admitted: AtomicU64,
    refused_sandbox: AtomicU64,
    refused_host: AtomicU64,
    refused_rate: AtomicU64,
}

/// One sandbox's streams: its cap, its bucket, its counts.
#[derive(Debug)]
pub struct SandboxTunnels {
    host: Arc<HostTunnels>,
    bucket: Mutex<Bucket>,
    counts: Arc<Counts>,
}

/// What [`SandboxTunnels::stats`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct TunnelStats {
    /// Streams open now.
    pub open: usize,
    /// Upstream sockets open now.
    pub upstream: usize,
    /// Streams admitted so far.
    pub admitted: u64,
    /// Refused: the sandbox's cap.
    pub refused_sandbox_cap: u64,
    /// Refused: the host's cap (streams or upstream sockets).
    pub refused_host_cap: u64,
    /// Refused: the open rate.
    pub refused_rate: u64,
    /// The sandbox's cap.
    pub limit: usize,
    /// Units the host holds now (every sandbox).
    pub host_units: usize,
    /// The host's cap.
    pub host_limit: usize,
}

impl SandboxTunnels {
    /// A sandbox's counters, sharing the host's.
    pub fn new(host: Arc<HostTunnels>) -> Self {
        let burst = f64::from(host.limits.burst);
        SandboxTunnels {
            host,
            bucket: Mutex::new(Bucket {
                tokens: burst,
                at: Instant::now(),
            }),
            counts: Arc::default(),
        }
    }

    /// The host's counters.
    pub fn host(&self) -> &Arc<HostTunnels> {
        &self.host
    }

    /// Admits one stream, or says why not.
    pub fn admit(&self) -> Result<Tunnel, Refused> {
        let r = self.try_admit();
        let c = &self.counts;
        match &r {
            Ok(_) => &c.admitted,
            Err(Refused::SandboxCap(_)) => &c.refused_sandbox,
            Err(Refused::HostCap(_)) => &c.refused_host,
            Err(Refused::Rate { .. }) => &c.refused_rate,
        }
        .fetch_add(1, Ordering::Relaxed);
        r
    }

    fn try_admit(&self) -> Result<Tunnel, Refused> {
        let l = self.host.limits;
        let mut bucket = self.bucket.lock().unwrap_or_else(|p| p.into_inner());
        if self.counts.open.load(Ordering::SeqCst) >= l.per_sandbox {
            return Err(Refused::SandboxCap(l.per_sandbox));
        }
        if l.rate > 0.0 {
            let now = Instant::now();
            let dt = now.duration_since(bucket.at).as_secs_f64();
            bucket.tokens = (bucket.tokens + dt * l.rate).min(f64::from(l.burst));
            bucket.at = now;
            if bucket.tokens < 1.0 {
                return Err(Refused::Rate {
                    rate: l.rate.round() as u32,
                    burst: l.burst,
                });
            }
        }
        let unit = self.host.try_unit()?;
        if l.rate > 0.0 {
            bucket.tokens -= 1.0;
        }
        self.counts.open.fetch_add(1, Ordering::SeqCst);
        Ok(Tunnel {
            _unit: unit,
            counts: self.counts.clone(),
            host: self.host.clone(),
        })
    }

    /// Counts and caps now.
    pub fn stats(&self) -> TunnelStats {
        let c = &self.counts;
        let l = self.host.limits;
        TunnelStats {
            open: c.open.load(Ordering::SeqCst),
            upstream: c.upstream.load(Ordering::SeqCst),
            admitted: c.admitted.load(Ordering::Relaxed),
            refused_sandbox_cap: c.refused_sandbox.load(Ordering::Relaxed),
            refused_host_cap: c.refused_host.load(Ordering::Relaxed),
            refused_rate: c.refused_rate.load(Ordering::Relaxed),
            limit: l.per_sandbox,
            host_units: self.host.units(),
            host_limit: l.host,
        }
    }
}

/// An admitted stream: holds its host unit and its place in the sandbox's
/// cap until dropped (when the stream is done).
#[derive(Debug)]
pub struct Tunnel {
    _unit: Unit,
    counts: Arc<Counts>,
    host: Arc<HostTunnels>,
}

impl Tunnel {
    /// A unit for one upstream socket of this stream (counted toward the
    /// host's cap), or [`Refused::HostCap`].
    pub fn upstream(&self) -> Result<UpstreamSlot, Refused> {
        let unit = self.host.try_unit().inspect_err(|_| {
            self.counts.refused_host.fetch_add(1, Ordering::Relaxed);
        })?;
        self.counts.upstream.fetch_add(1, Ordering::SeqCst);
        Ok(UpstreamSlot {
            _unit: unit,
            counts: self.counts.clone(),
        })
    }
}

impl Drop for Tunnel {
    fn drop(&mut self) {
        self.counts.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The host unit of one upstream socket; given back when dropped (keep it
/// as long as the socket).
#[derive(Debug)]
pub struct UpstreamSlot {
    _unit: Unit,
    counts: Arc<Counts>,
}

impl Drop for UpstreamSlot {
    fn drop(&mut self) {
        self.counts.upstream.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(per_sandbox: usize, host: usize, rate: f64, burst: u32) -> TunnelLimits {
        TunnelLimits {
            per_sandbox,
            host,
            rate,
            burst,
        }
    }

    #[test]
    fn sandbox_cap_and_release() {
        let s = SandboxTunnels::new(HostTunnels::new(limits(2, 100, 0.0, 0)));
        let a = s.admit().unwrap();
        let _b = s.admit().unwrap();
        assert_eq!(s.admit().unwrap_err(), Refused::SandboxCap(2));
        drop(a);
        let _c = s.admit().unwrap();
        let st = s.stats();
        assert_eq!((st.open, st.admitted, st.refused_sandbox_cap), (2, 3, 1));
        assert_eq!(st.host_units, 2);
    }

    #[test]
    fn host_cap_counts_upstream_sockets_across_sandboxes() {
        let host = HostTunnels::new(limits(10, 3, 0.0, 0));
        let (a, b) = (
            SandboxTunnels::new(host.clone()),
            SandboxTunnels::new(host.clone()),
        );
        let t1 = a.admit().unwrap();
        let up = t1.upstream().unwrap();
        let _t2 = b.admit().unwrap();
        assert_eq!(b.admit().unwrap_err(), Refused::HostCap(3));
        assert_eq!(t1.upstream().unwrap_err(), Refused::HostCap(3));
        assert_eq!(a.stats().upstream, 1);
        drop(up);
        assert_eq!(host.units(), 2);
        let _t3 = b.admit().unwrap();
        drop(t1);
        drop(a);
        assert_eq!(host.units(), 2);
    }

    #[test]
    fn rate_bucket_refuses_beyond_the_burst_and_refills() {
        let s = SandboxTunnels::new(HostTunnels::new(limits(100, 100, 20.0, 5)));
        for _ in 0..5 {
            drop(s.admit().unwrap());
        }
        assert!(matches!(
            s.admit(),
            Err(Refused::Rate { rate: 20, burst: 5 })
        ));
        std::thread::sleep(std::time::Duration::from_millis(120));
        drop(s.admit().unwrap());
        assert_eq!(s.stats().refused_rate, 1);
    }

    #[test]
    fn a_cap_refusal_takes_no_token() {
        let s = SandboxTunnels::new(HostTunnels::new(limits(1, 100, 0.001, 2)));
        let t = s.admit().unwrap();
        for _ in 0..10 {
            assert_eq!(s.admit().unwrap_err(), Refused::SandboxCap(1));
        }
        drop(t);
        drop(s.admit().unwrap());
        assert!(matches!(s.admit(), Err(Refused::Rate { .. })));
    }
}
