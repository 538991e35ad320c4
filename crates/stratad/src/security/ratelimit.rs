//! Per-token request rate limits: one token bucket per token id.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// Token buckets keyed by token id.
#[derive(Debug)]
pub struct RateLimiter {
    rate: f64,
    burst: f64,
    buckets: Mutex<HashMap<String, Bucket>>,
}

impl RateLimiter {
    /// `per_second` requests sustained, `burst` at once; `per_second == 0`
    /// turns the limit off.
    pub fn new(per_second: f64, burst: u32) -> Self {
        RateLimiter {
            rate: per_second.max(0.0),
            burst: f64::from(burst.max(1)),
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes one request's worth for `key` at `now`; `Err(wait)` when the
    /// bucket is empty (retry after `wait`).
    pub fn check_at(&self, key: &str, now: Instant) -> Result<(), Duration> {
        if self.rate <= 0.0 {
            return Ok(());
        }
        let mut g = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if g.len() > 100_000 {
            // Idle buckets are full buckets: dropping them changes nothing.
            let burst = self.burst;
            let rate = self.rate;
            g.retain(|_, b| b.tokens + now.duration_since(b.at).as_secs_f64() * rate < burst);
        }
        let b = g.entry(key.to_owned()).or_insert(Bucket {
            tokens: self.burst,
            at: now,
        });
        let elapsed = now.saturating_duration_since(b.at).as_secs_f64();
        b.tokens = (b.tokens + elapsed * self.rate).min(self.burst);
        b.at = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - b.tokens) / self.rate))
        }
    }

    /// [`RateLimiter::check_at`] now.
    pub fn check(&self, key: &str) -> Result<(), Duration> {
        self.check_at(key, Instant::now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_refills_at_the_rate() {
        let rl = RateLimiter::new(2.0, 3);
        let t0 = Instant::now();
        for _ in 0..3 {
            assert!(rl.check_at("a", t0).is_ok());
        }
        let wait = rl.check_at("a", t0).unwrap_err();
        assert!(wait <= Duration::from_millis(500) && wait > Duration::ZERO);
        assert!(rl.check_at("b", t0).is_ok(), "buckets are per key");
        assert!(rl.check_at("a", t0 + Duration::from_millis(510)).is_ok());
        assert!(rl.check_at("a", t0 + Duration::from_millis(510)).is_err());
        let off = RateLimiter::new(0.0, 1);
        for _ in 0..100 {
            assert!(off.check_at("a", t0).is_ok());
        }
    }
}
