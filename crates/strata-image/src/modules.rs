//! Kernel module load order, computed from the kernel package's `modules.dep`
//! (and the `pre:` soft dependencies of `modules.softdep`).

use std::collections::{BTreeMap, HashMap, HashSet};

/// Module name as the kernel sees it: file stem with `-` folded to `_`.
pub(crate) fn canonical_name(name_or_path: &str) -> String {
    let file = name_or_path.rsplit('/').next().unwrap_or(name_or_path);
    let stem = file.split(".ko").next().unwrap_or(file);
    stem.replace('-', "_")
}

/// A parsed `modules.dep`: module name → (relative path, dependency names).
#[derive(Debug, Default)]
pub(crate) struct ModuleDb {
    /// name → path relative to `lib/modules/<ver>/`.
    pub paths: HashMap<String, String>,
    deps: HashMap<String, Vec<String>>,
    soft_pre: HashMap<String, Vec<String>>,
    aliases: HashMap<String, Vec<String>>,
}

impl ModuleDb {
    /// Parses the text of `modules.dep`.
    pub fn parse_dep(text: &str) -> Self {
        let mut db = ModuleDb::default();
        for line in text.lines() {
            let Some((module, deps)) = line.split_once(':') else {
                continue;
            };
            let module = module.trim();
            if module.is_empty() {
                continue;
            }
            let name = canonical_name(module);
            db.paths.insert(name.clone(), module.to_string());
            db.deps
                .insert(name, deps.split_whitespace().map(canonical_name).collect());
        }
        db
    }

    /// Adds `softdep <mod> pre: <a> <b> post: ...` lines from `modules.softdep`.
    pub fn add_softdeps(&mut self, text: &str) {
        for line in text.lines() {
            let mut words = line.split_whitespace();
            if words.next() != Some("softdep") {
                continue;
            }
            let Some(module) = words.next() else { continue };
            let mut in_pre = false;
            for w in words {
                match w {
                    "pre:" => in_pre = true,
                    "post:" => in_pre = false,
                    other if in_pre => self
                        .soft_pre
                        .entry(canonical_name(module))
                        .or_default()
                        .push(other.to_string()),
                    _ => {}
                }
            }
        }
    }

    /// Adds `alias <name> <module>` lines from `modules.alias` (only the
    /// aliases without wildcards matter here).
    pub fn add_aliases(&mut self, text: &str) {
        for line in text.lines() {
            let mut words = line.split_whitespace();
            if words.next() != Some("alias") {
                continue;
            }
            if let (Some(alias), Some(module)) = (words.next(), words.next()) {
                if !alias.contains('*') {
                    self.aliases
                        .entry(alias.to_string())
                        .or_default()
                        .push(canonical_name(module));
                }
            }
        }
    }

    /// Load order for `wanted`: every module after its hard dependencies
    /// (added if not listed), and after those of its soft `pre:` dependencies
    /// that are themselves wanted. Otherwise the order of `wanted` is kept.
    /// Errors with the name of a wanted module that does not exist.
    pub fn load_order(&self, wanted: &[String]) -> Result<Vec<String>, String> {
        let wanted_names: Vec<String> = wanted.iter().map(|w| canonical_name(w)).collect();
        for w in &wanted_names {
            if !self.deps.contains_key(w) {
                return Err(w.clone());
            }
        }
        let wanted_set: HashSet<&String> = wanted_names.iter().collect();
        let mut order = Vec::new();
        let mut state: BTreeMap<String, bool> = BTreeMap::new(); // false = visiting, true = done
        for w in &wanted_names {
            self.visit(w, &wanted_set, &mut state, &mut order);
        }
        Ok(order)
    }

    fn visit(
        &self,
        m: &str,
        wanted: &HashSet<&String>,
        state: &mut BTreeMap<String, bool>,
        out: &mut Vec<String>,
    ) {
        if state.contains_key(m) {
            return; // done, or a cycle (only possible through soft deps): ignore
        }
        state.insert(m.to_string(), false);
        for soft in self.soft_pre.get(m).into_iter().flatten() {
            let targets = self
                .aliases
                .get(soft)
                .cloned()
                .unwrap_or_else(|| vec![canonical_name(soft)]);
            for t in targets.iter().filter(|t| wanted.contains(t)) {
                self.visit(t, wanted, state, out);
            }
        }
        // modules.dep lists the full transitive closure with the deepest
        // dependency last, so visiting each one recursively orders them.
        for dep in self.deps.get(m).into_iter().flatten() {
            self.visit(dep, wanted, state, out);
        }
        state.insert(m.to_string(), true);
        out.push(m.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Excerpt of Debian bookworm 6.1.0-57-amd64's modules.dep (generated by depmod).
    const DEP: &str = "\
kernel/fs/mbcache.ko:
kernel/fs/ext4/ext4.ko: kernel/lib/crc16.ko kernel/fs/mbcache.ko kernel/fs/jbd2/jbd2.ko
kernel/fs/jbd2/jbd2.ko:
kernel/lib/crc16.ko:
kernel/crypto/crc32c_generic.ko:
kernel/arch/x86/crypto/crc32c-intel.ko:
kernel/drivers/virtio/virtio.ko: kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/virtio/virtio_ring.ko:
kernel/drivers/virtio/virtio_mmio.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/char/hw_random/virtio-rng.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/char/virtio_console.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/block/virtio_blk.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/net/virtio_net.ko: kernel/drivers/net/net_failover.ko kernel/net/core/failover.ko kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/net/net_failover.ko: kernel/net/core/failover.ko
kernel/net/core/failover.ko:
";
    const SOFTDEP: &str =
        "# comment\nsoftdep ext4 pre: crypto-crc32c\nsoftdep jbd2 pre: crypto-crc32c\n";
    const ALIAS: &str = "alias crypto-crc32c crc32c_generic\nalias crypto-crc32c crc32c_intel\nalias virtio:d00000004v* virtio_rng\n";

    fn db() -> ModuleDb {
        let mut db = ModuleDb::parse_dep(DEP);
        db.add_softdeps(SOFTDEP);
        db.add_aliases(ALIAS);
        db
    }

    fn pos(order: &[String], m: &str) -> usize {
        order
            .iter()
            .position(|x| x == m)
            .unwrap_or_else(|| panic!("{m} missing from {order:?}"))
    }

    #[test]
    fn dependencies_come_first_and_are_added() {
        let order = db()
            .load_order(&["virtio_net".into(), "ext4".into(), "virtio_blk".into()])
            .unwrap();
        assert_eq!(
            order,
            [
                "failover",
                "net_failover",
                "virtio_ring",
                "virtio",
                "virtio_net",
                "crc16",
                "mbcache",
                "jbd2",
                "ext4",
                "virtio_blk"
            ]
        );
    }

    #[test]
    fn soft_pre_dependency_loads_first_when_wanted() {
        let order = db()
            .load_order(&["ext4".into(), "crc32c_generic".into()])
            .unwrap();
        assert!(pos(&order, "crc32c_generic") < pos(&order, "jbd2"));
        assert!(pos(&order, "jbd2") < pos(&order, "ext4"));
        // crc32c-intel is an alias target too but was not asked for.
        assert!(!order.contains(&"crc32c_intel".to_string()));
    }

    #[test]
    fn dashes_and_underscores_are_the_same_module() {
        let d = db();
        let order = d.load_order(&["virtio-rng".into()]).unwrap();
        assert_eq!(order, ["virtio_ring", "virtio", "virtio_rng"]);
        assert_eq!(
            d.paths["virtio_rng"],
            "kernel/drivers/char/hw_random/virtio-rng.ko"
        );
    }

    #[test]
    fn default_modules_order_is_complete_and_dependency_sorted() {
        let wanted: Vec<String> = crate::recipe::DEFAULT_MODULES
            .iter()
            .map(|s| s.to_string())
            .collect();
        let d = db();
        let order = d.load_order(&wanted).unwrap();
        assert_eq!(order.len(), wanted.len());
        for (i, m) in order.iter().enumerate() {
            for dep in &d.deps[m] {
                assert!(pos(&order, dep) < i, "{dep} after {m}");
            }
        }
    }

    #[test]
    fn unknown_module_is_reported() {
        assert_eq!(
            db().load_order(&["ext4".into(), "nosuch".into()])
                .unwrap_err(),
            "nosuch"
        );
    }

    #[test]
    fn canonical_names() {
        assert_eq!(canonical_name("kernel/x/virtio-rng.ko.xz"), "virtio_rng");
        assert_eq!(canonical_name("ext4.ko.zst"), "ext4");
        assert_eq!(canonical_name("ext4"), "ext4");
    }
}
