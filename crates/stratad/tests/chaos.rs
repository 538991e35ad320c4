//! The chaos driver (`strata_testkit::chaos`) in the suite: a real
//! `stratad` with real guests, two clients doing every operation, and a few
//! kills at random moments (`kill -9` of the daemon, of one QEMU, of one
//! guest's agent); after each, every invariant is checked against the
//! ledger of acknowledged answers and the host's own tables, and at the end
//! every acknowledged snapshot is restored. Under 3 minutes on 2 cores
//! (measured: 165 s with 8 kills while a chaos bench shared the host; 74 s
//! with 5 kills alone).
//!
//! Replay a run: `STRATA_CHAOS_SEED=<the seed printed> cargo test -p stratad --test chaos`
//! (the clients' timing still varies). More kills: `STRATA_CHAOS_KILLS=n`.

use std::time::Duration;

use strata_testkit::chaos::{run, seed_from_env, ChaosConfig};

#[test]
fn kills_at_random_moments_lose_nothing_acknowledged_and_leave_no_orphan() {
    let seed = seed_from_env();
    eprintln!("chaos seed {seed} (replay: STRATA_CHAOS_SEED={seed})");
    let image = strata_testkit::test_image();
    let mut cfg = ChaosConfig::new(image.dir.clone(), seed);
    cfg.kills = std::env::var("STRATA_CHAOS_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8);
    cfg.clients = 2;
    cfg.max_sandboxes = 4;
    cfg.gap = (Duration::from_secs(3), Duration::from_secs(8));
    cfg.sample = 2;
    cfg.weights = (2, 1, 1);
    let r = strata_testkit::tokio_rt()
        .block_on(run(cfg))
        .unwrap_or_else(|e| panic!("chaos setup: {e}"));
    eprintln!("{}", r.summary());
    assert!(
        r.violations.is_empty(),
        "{}\n--- daemon log (tail) ---\n{}",
        r.summary(),
        r.log_tail
    );
    assert!(r.kills() >= 3, "too few kills happened: {}", r.summary());
    assert!(r.acked_total() > 0, "{}", r.summary());
    assert!(
        r.envs_checked > 0,
        "no E2B-created sandbox's envVars were read back after a kill: {}",
        r.summary()
    );
}
