//! Injectable wall clock, so tests can drive schedules and retention.

use std::sync::Mutex;

use chrono::{DateTime, Utc};

/// A source of "now".
pub trait Clock: Send + Sync + 'static {
    /// The present time.
    fn now(&self) -> DateTime<Utc>;
}

/// The system clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// A clock that moves only when told (tests, simulations).
#[derive(Debug)]
pub struct ManualClock(Mutex<DateTime<Utc>>);

impl ManualClock {
    /// A clock showing `at`.
    pub fn new(at: DateTime<Utc>) -> Self {
        ManualClock(Mutex::new(at))
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: std::time::Duration) {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        *g += chrono::Duration::from_std(by).unwrap_or_default();
    }

    /// Sets the clock.
    pub fn set(&self, at: DateTime<Utc>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = at;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}
