//! Placement: which host a new sandbox goes to. A pure function over what
//! the hosts last reported ([`place`]); the daemon gathers its inputs
//! ([`super::Cluster::check_placement`]).
//!
//! Rules, in order:
//! 1. only live hosts (their registration unexpired) that have the
//!    request's vCPUs, memory and pool bytes free;
//! 2. anti-affinity: a request with the label [`ANTI_AFFINITY_LABEL`]
//!    never goes to a host that already runs a sandbox with the same value
//!    of that label;
//! 3. the most free vCPUs (CPU is the scarce resource), then the most free
//!    memory, then a host that holds the template already, then the
//!    smallest id (deterministic).

use std::fmt;

use super::super::store::hosts::{HostInfo, HostLoad};

/// The sandbox label whose value names an anti-affinity group: no two
/// sandboxes with the same value on one host.
pub const ANTI_AFFINITY_LABEL: &str = "strata.io/anti-affinity";

/// A host as placement sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// Host id.
    pub id: String,
    /// Its registration has not expired.
    pub alive: bool,
    /// What it last reported free.
    pub free: HostLoad,
    /// It holds the request's template.
    pub has_template: bool,
    /// How many of its sandboxes carry the request's anti-affinity value.
    pub same_group: u64,
}

/// What a new sandbox needs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Request {
    /// vCPUs.
    pub vcpus: u64,
    /// Memory, MiB.
    pub memory_mib: u64,
    /// Pool bytes it needs at least (0: not judged).
    pub pool_bytes: u64,
    /// It carries an anti-affinity label.
    pub anti_affinity: bool,
}

/// No host fits; `what_is_short` says why, for the error message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no host fits: {what_is_short}")]
pub struct NoHostFits {
    /// What is short, e.g. `vcpus: 4 wanted, at most 2 free (host-b)`.
    pub what_is_short: String,
}

struct Short<'a>(&'a str, u64, Option<(&'a str, u64)>);

impl fmt::Display for Short<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.2 {
            Some((h, n)) => write!(f, "{}: {} wanted, at most {n} free ({h})", self.0, self.1),
            None => write!(f, "{}: {} wanted", self.0, self.1),
        }
    }
}

/// Picks the host for `req` among `hosts` (see the module docs).
pub fn place<'a>(hosts: &'a [Candidate], req: &Request) -> Result<&'a str, NoHostFits> {
    let live: Vec<&Candidate> = hosts.iter().filter(|h| h.alive).collect();
    if live.is_empty() {
        return Err(NoHostFits {
            what_is_short: "no live host".into(),
        });
    }
    let fits = |h: &&Candidate| {
        h.free.vcpus >= req.vcpus
            && h.free.memory_mib >= req.memory_mib
            && h.free.pool_bytes >= req.pool_bytes
    };
    let roomy: Vec<&Candidate> = live.iter().copied().filter(fits).collect();
    if roomy.is_empty() {
        let most = |f: fn(&HostLoad) -> u64| {
            live.iter()
                .map(|h| (h.id.as_str(), f(&h.free)))
                .max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(a.0)))
        };
        let mut short = Vec::new();
        for (name, want, f) in [
            (
                "vcpus",
                req.vcpus,
                (|l: &HostLoad| l.vcpus) as fn(&HostLoad) -> u64,
            ),
            ("memory_mib", req.memory_mib, |l: &HostLoad| l.memory_mib),
            ("pool_bytes", req.pool_bytes, |l: &HostLoad| l.pool_bytes),
        ] {
            let m = most(f);
            if m.is_none_or(|(_, n)| n < want) {
                short.push(Short(name, want, m).to_string());
            }
        }
        if short.is_empty() {
            short.push(format!(
                "no single live host has {} vcpus, {} MiB and {} pool bytes free together",
                req.vcpus, req.memory_mib, req.pool_bytes
            ));
        }
        return Err(NoHostFits {
            what_is_short: short.join("; "),
        });
    }
    let spread: Vec<&Candidate> = if req.anti_affinity {
        roomy
            .iter()
            .copied()
            .filter(|h| h.same_group == 0)
            .collect()
    } else {
        roomy
    };
    spread
        .into_iter()
        .min_by(|a, b| {
            b.free
                .vcpus
                .cmp(&a.free.vcpus)
                .then(b.free.memory_mib.cmp(&a.free.memory_mib))
                .then(b.has_template.cmp(&a.has_template))
                .then(a.id.cmp(&b.id))
        })
        .map(|h| h.id.as_str())
        .ok_or_else(|| NoHostFits {
            what_is_short: format!(
                "anti-affinity: every host with room runs a sandbox of the same {ANTI_AFFINITY_LABEL} group"
            ),
        })
}

/// Whether a sandbox whose newest state was made on host `from` can run
/// on host `to` after a move: the same accelerator, the same QEMU release
/// series (device state moves only within one, as
/// [`strata_runtime::meta::same_qemu_series`] judges restores), and, under
/// KVM, the same CPU model (the guest saw the host's CPU; TCG emulates one
/// model everywhere). Checked before anything is sent, so a move that
/// could not wake on its target is refused instead of handed over. The
/// error says what differs.
pub fn move_compatible(from: &HostInfo, to: &HostInfo) -> Result<(), String> {
    if from.accel != to.accel {
        return Err(format!(
            "host {} runs accel {}, this sandbox's state was made under {} on host {}",
            to.id, to.accel, from.accel, from.id
        ));
    }
    if !strata_runtime::meta::same_qemu_series(&from.qemu_version, &to.qemu_version) {
        return Err(format!(
            "host {} runs {:?}, this sandbox's state was made under {:?} on host {} \
             (device state moves only within one QEMU release series)",
            to.id, to.qemu_version, from.qemu_version, from.id
        ));
    }
    if from.accel == "kvm" && from.cpu_model != to.cpu_model {
        return Err(format!(
            "host {} has CPU {:?}, this sandbox's state was made on {:?} (host {}); \
             under KVM a guest moves only between hosts of the same CPU model",
            to.id, to.cpu_model, from.cpu_model, from.id
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(id: &str, vcpus: u64, mem: u64) -> Candidate {
        Candidate {
            id: id.into(),
            alive: true,
            free: HostLoad {
                vcpus,
                memory_mib: mem,
                pool_bytes: 1 << 40,
            },
            has_template: false,
            same_group: 0,
        }
    }

    fn req(vcpus: u64, mem: u64) -> Request {
        Request {
            vcpus,
            memory_mib: mem,
            pool_bytes: 1 << 30,
            anti_affinity: false,
        }
    }

    #[test]
    fn cpu_decides_first_then_memory_then_template_then_id() {
        let hosts = [h("a", 4, 90_000), h("b", 8, 1000), h("c", 8, 2000)];
        assert_eq!(place(&hosts, &req(1, 512)), Ok("c"));
        let mut hosts = [h("a", 8, 2000), h("b", 8, 2000)];
        assert_eq!(place(&hosts, &req(1, 512)), Ok("a"));
        hosts[1].has_template = true;
        assert_eq!(place(&hosts, &req(1, 512)), Ok("b"));
    }

    #[test]
    fn dead_and_full_hosts_are_skipped() {
        let mut hosts = [h("a", 16, 64_000), h("b", 2, 1024), h("c", 1, 100_000)];
        hosts[0].alive = false;
        assert_eq!(place(&hosts, &req(2, 1024)), Ok("b"));
        assert_eq!(place(&hosts, &req(1, 2048)), Ok("c"));
    }

    #[test]
    fn refusals_say_what_is_short() {
        let hosts = [h("a", 2, 1024), h("b", 1, 4096)];
        let e = place(&hosts, &req(4, 512)).unwrap_err();
        assert_eq!(
            e.what_is_short, "vcpus: 4 wanted, at most 2 free (a)",
            "{e}"
        );
        let e = place(&hosts, &req(2, 2048)).unwrap_err();
        assert!(e.what_is_short.contains("together"), "{e}");
        let e = place(&hosts, &req(8, 8192)).unwrap_err();
        assert_eq!(
            e.what_is_short,
            "vcpus: 8 wanted, at most 2 free (a); memory_mib: 8192 wanted, at most 4096 free (b)"
        );
        let mut dead = hosts.clone();
        dead.iter_mut().for_each(|h| h.alive = false);
        assert_eq!(
            place(&dead, &req(1, 1)).unwrap_err().what_is_short,
            "no live host"
        );
        assert_eq!(
            place(&[], &req(1, 1)).unwrap_err().what_is_short,
            "no live host"
        );
    }

    #[test]
    fn anti_affinity_spreads_a_group_and_refuses_when_it_cannot() {
        let mut hosts = [h("a", 16, 64_000), h("b", 2, 2048)];
        hosts[0].same_group = 1;
        let mut r = req(1, 512);
        assert_eq!(place(&hosts, &r), Ok("a"), "without the label: most CPU");
        r.anti_affinity = true;
        assert_eq!(place(&hosts, &r), Ok("b"));
        hosts[1].same_group = 2;
        let e = place(&hosts, &r).unwrap_err();
        assert!(e.what_is_short.starts_with("anti-affinity"), "{e}");
    }

    #[test]
    fn a_thousand_hosts_place_in_a_fraction_of_a_millisecond() {
        let hosts: Vec<Candidate> = (0..1000)
            .map(|i| h(&format!("h{i:04}"), i % 64, (i * 977) % 65_536))
            .collect();
        let t = std::time::Instant::now();
        let mut last = "";
        for _ in 0..100 {
            last = place(&hosts, &req(2, 1024)).unwrap();
        }
        assert!(last.starts_with('h'));
        // A smoke bound only (debug build, shared machine); the benchmark
        // reports the real figures.
        assert!(t.elapsed() < std::time::Duration::from_secs(2));
    }

    fn host(id: &str, accel: &str, qemu: &str, cpu: &str) -> HostInfo {
        HostInfo {
            id: id.into(),
            address: format!("http://{id}:7391"),
            accel: accel.into(),
            qemu_version: qemu.into(),
            cpu_model: cpu.into(),
            capacity: HostLoad::default(),
        }
    }

    #[test]
    fn moves_need_the_same_accel_qemu_series_and_under_kvm_cpu_model() {
        let deb = "QEMU emulator version 7.2.19 (Debian 1:7.2+dfsg-7+deb12u12)";
        let deb_update = "QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u16)";
        let a = host("a", "tcg", deb, "Intel Xeon");
        // TCG emulates one CPU everywhere; a QEMU security update is the
        // same series.
        assert_eq!(
            move_compatible(&a, &host("b", "tcg", deb_update, "AMD EPYC")),
            Ok(())
        );
        let e =
            move_compatible(&a, &host("b", "tcg", "QEMU emulator version 8.2.2", "x")).unwrap_err();
        assert!(e.contains("release series") && e.contains("host b"), "{e}");
        let e = move_compatible(&a, &host("b", "kvm", deb, "Intel Xeon")).unwrap_err();
        assert!(e.contains("accel kvm"), "{e}");
        let k = host("k", "kvm", deb, "Intel Xeon Gold 6230");
        assert_eq!(
            move_compatible(&k, &host("k2", "kvm", deb_update, "Intel Xeon Gold 6230")),
            Ok(())
        );
        let e = move_compatible(&k, &host("k3", "kvm", deb, "AMD EPYC 7B13")).unwrap_err();
        assert!(
            e.contains("CPU model") && e.contains("AMD EPYC 7B13"),
            "{e}"
        );
    }
}
