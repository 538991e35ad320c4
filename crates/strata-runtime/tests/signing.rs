//! State signatures with real guests under TCG on a real btrfs pool
//! (`strata_runtime::signing`): a snapshot whose `device.state` an attacker
//! with write access to the pool changed is refused as unusable on every
//! restore path (rewind, fork, restore) and the sandbox runs on; the same
//! snapshot untouched restores; another deployment's runtime refuses this
//! deployment's snapshots; a state made before signing is refused until
//! adopted, then restores; hibernate and wake sign and verify; a template
//! travels between deployments through the template cache.

use std::path::Path;
use std::sync::Arc;

use strata_core::{SandboxId, SnapshotId, TemplateId};
use strata_runtime::{Adoption, Runtime, RuntimeError, Source, StateSigner};

mod common;

use common::{sh, size, tokio_rt, TestRuntime};

fn signer(seed: u8) -> Arc<StateSigner> {
    Arc::new(StateSigner::from_seed(&[seed; 32]).expect("signer"))
}

/// What an attacker with write access to the pool does: opens the
/// read-only subvolume, changes it with `change`, closes it again.
fn with_writable(rt: &Runtime, dir: &Path, change: impl FnOnce(&Path)) {
    rt.pool().set_readonly(dir, false).expect("writable");
    change(dir);
    rt.pool().set_readonly(dir, true).expect("read-only again");
}

/// Flips one bit of `dir/device.state` in the middle of the file.
fn flip_device_state(dir: &Path) {
    let p = dir.join("device.state");
    let mut b = std::fs::read(&p).expect("device.state");
    let i = b.len() / 2;
    b[i] ^= 0x01;
    std::fs::write(&p, b).expect("write device.state");
}

fn unusable(e: &RuntimeError, want: &str) -> bool {
    matches!(e, RuntimeError::SnapshotUnusable { reason, .. } if reason.contains(want))
}

#[test]
fn tampered_foreign_and_unsigned_states_are_refused_and_signed_ones_restore() {
    let t = TestRuntime::start("strsig-", size(), |c| c.signing = Some(signer(1)));
    let rt = &t.rt;
    assert!(rt.signs_states());
    tokio_rt().block_on(async {
        // Made from the signed template (a create verifies it).
        let a = SandboxId::generate();
        rt.create(&a, &Source::Template(t.template.clone()), None)
            .await
            .expect("create from the signed template");
        sh(rt, &a, "echo at-snapshot > /root/f; sync").await;
        let snap = SnapshotId::generate();
        let info = rt.snapshot(&a, &snap).await.expect("snapshot");
        let dir = rt.pool().snapshots_dir().join(snap.as_str());
        assert!(
            dir.join("state.sig").is_file(),
            "signed inside the subvolume"
        );
        eprintln!("device.state {} B", info.device_state_bytes);
        sh(rt, &a, "echo after > /root/f; sync").await;

        // One bit of device.state flipped: rewind, fork and restore refuse.
        with_writable(rt, &dir, flip_device_state);
        let e = rt.rewind(&a, &snap, None).await.unwrap_err();
        assert!(unusable(&e, "device.state was changed"), "{e}");
        assert_eq!(e.code(), strata_core::ErrorCode::SnapshotUnusable);
        assert_eq!(
            sh(rt, &a, "cat /root/f").await,
            "after",
            "a refused rewind changes nothing"
        );
        let b = SandboxId::generate();
        let e = rt
            .create(&b, &Source::Snapshot(snap.clone()), None)
            .await
            .unwrap_err();
        assert!(unusable(&e, "device.state was changed"), "{e}");
        assert!(
            !rt.pool().sandboxes_dir().join(b.as_str()).exists(),
            "a refused fork leaves no subvolume"
        );
        // A changed meta.json (e.g. another network or command line) too.
        with_writable(rt, &dir, |d| {
            flip_device_state(d);
            let p = d.join("meta.json");
            let text = std::fs::read_to_string(&p).expect("meta");
            std::fs::write(
                &p,
                text.replacen("\"cmdline\": \"", "\"cmdline\": \"init=/bin/sh ", 1),
            )
            .expect("meta");
        });
        let e = rt.rewind(&a, &snap, None).await.unwrap_err();
        assert!(unusable(&e, "meta.json was changed"), "{e}");

        // The untampered snapshot restores (the attacker's meta undone).
        let pristine = SnapshotId::generate();
        rt.snapshot(&a, &pristine).await.expect("snapshot");
        sh(rt, &a, "echo later > /root/f; sync").await;
        rt.rewind(&a, &pristine, None)
            .await
            .expect("rewind to a signed snapshot");
        assert_eq!(sh(rt, &a, "cat /root/f").await, "after");
        rt.create(&b, &Source::Snapshot(pristine.clone()), None)
            .await
            .expect("fork of a signed snapshot");
        assert_eq!(sh(rt, &b, "cat /root/f").await, "after");
        rt.delete(&b).await.expect("delete fork");

        // Hibernate and wake: the wake snapshot is signed and checked.
        let hib = SnapshotId::generate();
        rt.hibernate(&a, &hib).await.expect("hibernate");
        let hdir = rt.pool().snapshots_dir().join(hib.as_str());
        assert!(hdir.join("state.sig").is_file());
        rt.wake(&a, &hib).await.expect("wake");
        assert_eq!(sh(rt, &a, "cat /root/f").await, "after");

        // A state made before signing (no signature at all): refused until
        // adopted, then it restores; adopting again changes nothing; once
        // adopted, a changed device.state is refused like any other.
        let legacy = SnapshotId::generate();
        rt.snapshot(&a, &legacy).await.expect("snapshot");
        let ldir = rt.pool().snapshots_dir().join(legacy.as_str());
        with_writable(rt, &ldir, |d| {
            std::fs::remove_file(d.join("state.sig")).expect("rm")
        });
        let e = rt
            .create(
                &SandboxId::generate(),
                &Source::Snapshot(legacy.clone()),
                None,
            )
            .await
            .unwrap_err();
        assert!(unusable(&e, "no signature"), "{e}");
        let src = Source::Snapshot(legacy.clone());
        assert_eq!(
            rt.adopt_unsigned(&src).await.expect("adopt"),
            Adoption::Signed
        );
        assert!(
            !ldir.join("state.sig").exists(),
            "the read-only subvolume is untouched"
        );
        assert_eq!(
            rt.adopt_unsigned(&src).await.expect("adopt again"),
            Adoption::AlreadySigned
        );
        let c = SandboxId::generate();
        rt.create(&c, &src, None)
            .await
            .expect("fork of an adopted snapshot");
        assert_eq!(sh(rt, &c, "cat /root/f").await, "after");
        rt.delete(&c).await.expect("delete");
        with_writable(rt, &ldir, flip_device_state);
        let e = rt.create(&c, &src, None).await.unwrap_err();
        assert!(unusable(&e, "device.state was changed"), "{e}");
        assert!(matches!(
            rt.adopt_unsigned(&src).await.expect("adopt a tampered one"),
            Adoption::Refused(_)
        ));
        // The tampered snapshot's own signature, once signed inside, is
        // never replaced by an adoption either.
        assert!(matches!(
            rt.adopt_unsigned(&Source::Snapshot(snap.clone()))
                .await
                .expect("adopt"),
            Adoption::Refused(_)
        ));

        // Another deployment (another key) on the same pool: this
        // deployment's snapshot is foreign there.
        let run_b = tempfile::Builder::new()
            .prefix("strsigb-")
            .tempdir_in("/tmp")
            .expect("run dir");
        let mut cfg_b = rt.config().clone();
        cfg_b.run_dir = run_b.path().to_path_buf();
        cfg_b.signing = Some(signer(2));
        let rt_b = Runtime::open(cfg_b).await.expect("second runtime");
        let e = rt_b
            .create(
                &SandboxId::generate(),
                &Source::Snapshot(pristine.clone()),
                None,
            )
            .await
            .unwrap_err();
        assert!(unusable(&e, "another deployment's key"), "{e}");

        // The template cache: exported by this deployment, imported and
        // signed by the other, whose sandbox then starts from it; a changed
        // entry is refused.
        let cache = tempfile::tempdir().expect("cache");
        let entry = cache.path().join("entry");
        rt.export_template(&t.template, &entry)
            .await
            .expect("export");
        assert!(
            !entry.join("state.sig").exists(),
            "no signature in the cache"
        );
        assert!(entry.join("export.json").is_file());
        let tpl_b = TemplateId::generate();
        rt_b.import_template(&entry, &tpl_b).await.expect("import");
        let d = SandboxId::generate();
        rt_b.create(&d, &Source::Template(tpl_b.clone()), None)
            .await
            .expect("a sandbox of the imported template");
        assert_eq!(sh(&rt_b, &d, "echo imported").await, "imported");
        rt_b.delete(&d).await.expect("delete");
        flip_device_state(&entry);
        let e = rt_b
            .import_template(&entry, &TemplateId::generate())
            .await
            .unwrap_err();
        assert!(unusable(&e, "device.state differs"), "{e}");
        // This deployment refuses the other's template.
        let e = rt
            .create(
                &SandboxId::generate(),
                &Source::Template(tpl_b.clone()),
                None,
            )
            .await
            .unwrap_err();
        assert!(unusable(&e, "another deployment's key"), "{e}");
        rt_b.delete_template(&tpl_b).await.expect("delete template");
        rt.delete(&a).await.expect("delete");
    });
}
