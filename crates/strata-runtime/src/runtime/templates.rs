//! Templates: the only cold boot. A template is a read-only snapshot of a
//! freshly booted guest; every sandbox starts from one (or from a snapshot).
//!
//! Contract:
//! - A build works in a scratch subvolume `sandboxes/build-<tpl>` and
//!   publishes `templates/<tpl>` with one read-only btrfs snapshot at the
//!   end, so a template either exists whole or not at all; the scratch
//!   subvolume, run dir and VM are gone afterwards, built or not.
//! - The template carries the kernel, initrd, RAM, disk and device state a
//!   restore needs, and a `meta.json` without a sandbox.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use chrono::Utc;
use strata_core::{SandboxId, SandboxSize, SnapshotId, TemplateId};
use strata_image::BuiltImage;
use strata_proto::ExecRequest;
use strata_vmm::{ResolvedAccel, VmmDriver};

use super::vms::Live;
use super::{blocking, load_image, ms, Result, Runtime, StateRef};
use crate::error::{io_err, storage_err, vmm_err, RuntimeError};
use crate::meta::{files, layout_hash, StateMeta, SNAPSHOT_FORMAT_VERSION};
use crate::signing::StateHashes;

/// Figures of a template build.
#[derive(Debug, Clone)]
pub struct TemplateBuilt {
    /// Template id.
    pub id: TemplateId,
    /// Size the template guest runs with.
    pub size: SandboxSize,
    /// Accelerator.
    pub accel: String,
    /// Cold boot to agent-ready, in ms.
    pub boot_ms: f64,
    /// Whole build, in ms.
    pub build_ms: f64,
}

/// Where a build works: the template, its scratch subvolume and the name
/// its VM runs under.
struct Build<'a> {
    tpl: &'a TemplateId,
    id: String,
    work: std::path::PathBuf,
    size: SandboxSize,
    accel: ResolvedAccel,
    /// PEM certificates the guest's system bundle gets before the snapshot.
    trust: Option<&'a str>,
}

/// The guest's system CA bundle (Debian's: what curl, pip, git and
/// Python's `ssl` read), which a trusted CA is appended to.
pub const SYSTEM_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// Where a template built with a trusted CA keeps a copy of it (the system
/// bundle has it appended too).
pub const TRUSTED_CA_PATH: &str = "/usr/local/share/ca-certificates/strata-trusted.crt";

/// `pem` is PEM certificates only: the lines go into a guest shell's
/// here-document, so nothing but base64 and the BEGIN/END lines passes.
fn check_pem(pem: &str) -> Result<()> {
    let ok = pem.contains("-----BEGIN CERTIFICATE-----")
        && pem.lines().all(|l| {
            let l = l.trim_end();
            l.is_empty()
                || l == "-----BEGIN CERTIFICATE-----"
                || l == "-----END CERTIFICATE-----"
                || l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'/' || b == b'=')
        });
    if ok {
        Ok(())
    } else {
        Err(RuntimeError::Invalid(
            "trusted CA: PEM certificates only".into(),
        ))
    }
}

impl Runtime {
    /// Boots the image once (cold), waits for its agent, and snapshots it as template
    /// `tpl`. The template's subvolume carries kernel, initrd, RAM, disk and device state.
    pub async fn build_template(
        self: &Arc<Self>,
        tpl: &TemplateId,
        size: SandboxSize,
        progress: &(dyn Fn(&str) + Send + Sync),
    ) -> Result<TemplateBuilt> {
        self.build_template_trusting(tpl, size, progress, None)
            .await
    }

    /// [`Runtime::build_template`], and before the snapshot the booted
    /// guest's system CA bundle (`/etc/ssl/certs/ca-certificates.crt`, what
    /// curl, pip, git and Python's `ssl` read) gets the PEM certificates of
    /// `trust` appended, with a copy at [`TRUSTED_CA_PATH`] (for
    /// `NODE_EXTRA_CA_CERTS`): the deployment's TLS interception CA, so every
    /// sandbox of the template trusts it and nothing is installed at a fork.
    pub async fn build_template_trusting(
        self: &Arc<Self>,
        tpl: &TemplateId,
        size: SandboxSize,
        progress: &(dyn Fn(&str) + Send + Sync),
        trust: Option<&str>,
    ) -> Result<TemplateBuilt> {
        if let Some(pem) = trust {
            check_pem(pem)?;
        }
        size.validate()
            .map_err(|e| RuntimeError::Invalid(e.to_string()))?;
        let _g = self.op_lock(tpl.as_str()).await;
        let t0 = Instant::now();
        if self.template_dir(tpl).exists() {
            return Err(RuntimeError::Invalid(format!(
                "template {tpl} already exists"
            )));
        }
        let image = load_image(&self.cfg.image_dir)?;
        let accel = self.accel().await?;
        progress(&format!("accelerator: {}", accel.qemu_name()));
        // Build in a scratch sandbox subvolume, then snapshot it read-only.
        let id = format!("build-{}", tpl.as_str());
        let work = self.pool.sandboxes_dir().join(&id);
        let pool = self.pool.clone();
        let w = work.clone();
        blocking(move || {
            clear_scratch(&pool, &w)?;
            pool.create_subvolume(&w).map_err(storage_err).map(|_| ())
        })
        .await?;
        let build = Build {
            tpl,
            id,
            work,
            size,
            accel,
            trust,
        };
        let result = self.build_template_in(&build, &image, progress).await;
        let pool = self.pool.clone();
        let w = build.work.clone();
        let _ = blocking(move || pool.trash(&w).map_err(storage_err)).await;
        let boot_ms = result?;
        progress("template ready");
        Ok(TemplateBuilt {
            id: tpl.clone(),
            size,
            accel: accel.qemu_name().to_owned(),
            boot_ms,
            build_ms: ms(t0),
        })
    }

    /// Fills the scratch subvolume, boots it, snapshots the booted guest as
    /// the template. Returns the cold boot's time to agent-ready, in ms.
    async fn build_template_in(
        self: &Arc<Self>,
        b: &Build<'_>,
        image: &BuiltImage,
        progress: &(dyn Fn(&str) + Send + Sync),
    ) -> Result<f64> {
        progress("copying kernel, initrd and root disk into the pool");
        let kernel_src = match (b.accel, &image.kernel_pvh) {
            (ResolvedAccel::Tcg, Some(pvh)) => pvh.clone(),
            _ => image.kernel.clone(),
        };
        let copies = [
            (kernel_src, b.work.join(files::KERNEL)),
            (image.initrd.clone(), b.work.join(files::INITRD)),
            (image.rootfs.clone(), b.work.join(files::DISK)),
        ];
        let disk_bytes = b.size.disk_bytes();
        blocking(move || {
            for (src, dst) in &copies {
                copy_sparse(src, dst).map_err(|e| io_err("copy image file", e))?;
            }
            grow_ext4(&copies[2].1, disk_bytes)
        })
        .await?;
        let meta = StateMeta {
            format_version: SNAPSHOT_FORMAT_VERSION,
            strata_version: strata_core::STRATA_VERSION.to_owned(),
            qemu_version: self.qemu_version.clone(),
            accel: b.accel.qemu_name().to_owned(),
            machine_layout: String::new(),
            // A cold boot: the newest layout.
            layout_version: strata_vmm::cmdline::MACHINE_LAYOUT_VERSION,
            size: b.size,
            cmdline: image.cmdline.clone(),
            image_hash: image.hash.clone(),
            kernel_version: image.kernel_version.clone(),
            net: strata_vmm::NetSpec::default(),
            sandbox: None,
            template: Some(b.tpl.to_string()),
            hostname: Some("strata".into()),
            first_start: None,
            disk_only: false,
            recipe: None,
            starts: None,
            written_at: Utc::now(),
        };
        let mut spec = self.spec_for(&b.id, &b.work, &meta, b.accel);
        let meta = StateMeta {
            machine_layout: layout_hash(&spec),
            ..meta
        };
        meta.write(&b.work)
            .map_err(|e| io_err("write meta.json", e))?;
        progress("booting the guest (cold boot; only templates do this)");
        let t_boot = Instant::now();
        spec.start_paused = false;
        let vm = self
            .driver
            .start(&spec)
            .await
            .map_err(|e| vmm_err(&b.id, e))?;
        // Never registered: the build itself ends this VM.
        let live = Live::new(vm, b.size);
        live.stopping.store(true, Ordering::SeqCst);
        let fake_id: SandboxId = format!("sb-{}", b.id.replace('_', "-"))
            .parse()
            .map_err(|e: strata_core::id::IdError| RuntimeError::Other(e.to_string()))?;
        let outcome = async {
            let agent = self.agent_of(&fake_id, &live).await?;
            let boot_ms = ms(t_boot);
            progress(&format!("agent ready after {boot_ms:.0} ms"));
            if let Some(pem) = b.trust {
                progress("adding the trusted CA to the guest's system bundle");
                let script = format!(
                    "set -e; mkdir -p {dir}; cat > {TRUSTED_CA_PATH} <<'STRATA_PEM'\n{pem}\nSTRATA_PEM\n\
                     cat {TRUSTED_CA_PATH} >> {SYSTEM_CA_BUNDLE}",
                    dir = "/usr/local/share/ca-certificates",
                    pem = pem.trim_end(),
                );
                let out = agent
                    .exec_collect(ExecRequest::shell(&script))
                    .await
                    .map_err(|e| crate::error::agent_err(&b.id, e, self.agent_timeout()))?;
                if !out.status.success() {
                    return Err(RuntimeError::Other(format!(
                        "adding the trusted CA failed ({:?}): {}",
                        out.status,
                        String::from_utf8_lossy(&out.stderr)
                    )));
                }
            }
            // Let the guest settle (udev-less, but the page cache and timers calm down).
            let _ = agent
                .exec_collect(ExecRequest::shell(
                    "sync; echo 1 > /proc/sys/vm/drop_caches || true",
                ))
                .await;
            drop(agent);
            progress("snapshotting the booted guest");
            live.pause_vm().await.map_err(|e| vmm_err(&b.id, e))?;
            self.save_state(&b.id, &live, &b.work).await?;
            let pool = self.pool.clone();
            let w = b.work.clone();
            let dst = self.template_dir(b.tpl);
            let signer = self.cfg.signing.clone();
            let name = b.tpl.to_string();
            blocking(move || {
                super::signatures::sign_into(signer.as_deref(), &w, &name, None)?;
                pool.snapshot(&w, &dst, true)
                    .map_err(storage_err)
                    .map(|_| ())
            })
            .await?;
            Ok::<f64, RuntimeError>(boot_ms)
        }
        .await;
        let _ = live.vm.kill().await;
        let _ = std::fs::remove_dir_all(self.run_dir(&b.id));
        outcome
    }

    /// Publishes snapshot `snap` (of a builder sandbox, taken while its
    /// guest ran the recipe's steps) as template `tpl`: its RAM, disk and
    /// device state become a read-only `templates/<tpl>` whose `meta.json`
    /// names the template, no sandbox, `recipe` (the recipe hash) and
    /// `starts` (what its guest had started, for size variants). The
    /// snapshot stays (the caller deletes it). Like a cold build, the
    /// template exists whole or not at all: the meta is rewritten in a
    /// scratch subvolume, which is then snapshotted read-only.
    pub async fn template_from_snapshot(
        &self,
        snap: &SnapshotId,
        tpl: &TemplateId,
        recipe: Option<String>,
        starts: Option<Vec<crate::meta::StartCommand>>,
    ) -> Result<()> {
        let _g = self.op_lock(tpl.as_str()).await;
        let src = self.snapshot_dir(snap);
        let dst = self.template_dir(tpl);
        // A template is signed only from a snapshot that verifies.
        let opened = self.open_state(StateRef::Snapshot(snap))?;
        let verified = self.check_signature(&opened, &opened.dir)?;
        if dst.exists() {
            return Err(RuntimeError::Invalid(format!(
                "template {tpl} already exists"
            )));
        }
        self.check_free_space()?;
        let scratch = self
            .pool
            .sandboxes_dir()
            .join(format!("pub-{}", tpl.as_str()));
        let pool = self.pool.clone();
        let tpl_name = tpl.to_string();
        let snap_name = snap.to_string();
        let signer = self.cfg.signing.clone();
        blocking(move || {
            clear_scratch(&pool, &scratch)?;
            pool.snapshot(&src, &scratch, false).map_err(storage_err)?;
            let published = (|| {
                let meta =
                    StateMeta::read(&scratch).map_err(|e| RuntimeError::SnapshotUnusable {
                        id: snap_name.clone(),
                        reason: e.0,
                    })?;
                let meta = StateMeta {
                    recipe,
                    starts,
                    ..meta
                };
                let sign = Signing {
                    signer: signer.as_deref(),
                    source: verified.as_ref(),
                };
                publish_scratch(&pool, &scratch, &dst, meta, tpl_name, sign).map(|_| ())
            })();
            let _ = pool.trash(&scratch);
            published
        })
        .await
    }

    /// Copies template `tpl`'s files (sparse) into the new directory
    /// `dest` (written as `dest.tmp-*` and renamed, so `dest` is whole or
    /// absent): a host-level cache entry another daemon can import.
    ///
    /// Signatures across deployments: the daemons sharing a host's cache
    /// have different keys, so an entry carries no signature (`state.sig`
    /// is left out). The template is verified with this deployment's key
    /// before it is copied, and the entry gets a content record
    /// ([`files::EXPORT_RECORD`]: SHA-256 of the copied `meta.json` and
    /// `device.state`) that [`Runtime::import_template`] checks before it
    /// signs the import with the importing deployment's key. The record
    /// catches a torn or changed entry; it is not a signature: whoever can
    /// write the cache directory can make an entry every importer trusts.
    pub async fn export_template(&self, tpl: &TemplateId, dest: &Path) -> Result<()> {
        let src = self.template_dir(tpl);
        let opened = self.open_state(StateRef::Template(tpl))?;
        self.check_signature(&opened, &opened.dir)?;
        let dest = dest.to_path_buf();
        let tpl_name = tpl.to_string();
        blocking(move || {
            if dest.exists() {
                return Ok(());
            }
            let parent = dest
                .parent()
                .ok_or_else(|| RuntimeError::Invalid("cache entry has no parent".into()))?;
            std::fs::create_dir_all(parent).map_err(|e| io_err("create template cache", e))?;
            let tmp = parent.join(format!(
                ".{}.tmp-{}",
                dest.file_name()
                    .map(|n| n.to_string_lossy())
                    .unwrap_or_default(),
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&tmp);
            std::fs::create_dir(&tmp).map_err(|e| io_err("create template cache entry", e))?;
            let copied =
                copy_state_files(&src, &tmp).and_then(|()| ExportRecord::write(&tmp, &tpl_name));
            match copied.and_then(|()| {
                std::fs::rename(&tmp, &dest).map_err(|e| io_err("publish cache entry", e))
            }) {
                Ok(()) => Ok(()),
                Err(e) => {
                    let _ = std::fs::remove_dir_all(&tmp);
                    Err(e)
                }
            }
        })
        .await
    }

    /// Makes template `tpl` from a directory [`Runtime::export_template`]
    /// wrote (any daemon's): its content record checked (the copied
    /// `meta.json` and `device.state` hash as recorded; an entry without
    /// one, written before signing, is refused and rebuilt by the caller),
    /// checked restorable on this host (QEMU series, accelerator, every
    /// file present), then published read-only with its meta naming `tpl`
    /// and no sandbox, signed with this deployment's key.
    pub async fn import_template(&self, src: &Path, tpl: &TemplateId) -> Result<StateMeta> {
        let _g = self.op_lock(tpl.as_str()).await;
        let dst = self.template_dir(tpl);
        if dst.exists() {
            return Err(RuntimeError::Invalid(format!(
                "template {tpl} already exists"
            )));
        }
        self.check_free_space()?;
        let accel = self.accel().await?;
        let scratch = self
            .pool
            .sandboxes_dir()
            .join(format!("imp-{}", tpl.as_str()));
        let pool = self.pool.clone();
        let (src, tpl_name, qemu) = (
            src.to_path_buf(),
            tpl.to_string(),
            self.qemu_version.clone(),
        );
        let signer = self.cfg.signing.clone();
        blocking(move || {
            clear_scratch(&pool, &scratch)?;
            pool.create_subvolume(&scratch).map_err(storage_err)?;
            let done = (|| {
                copy_state_files(&src, &scratch)?;
                let bad = |e: crate::meta::Incompatible| RuntimeError::SnapshotUnusable {
                    id: tpl_name.clone(),
                    reason: format!("cached template: {}", e.0),
                };
                let (meta, bytes) = StateMeta::read_with_bytes(&scratch).map_err(bad)?;
                let checked = ExportRecord::check(&scratch, &bytes, meta.disk_only)
                    .map_err(|e| bad(crate::meta::Incompatible(e)))?;
                meta.check_restorable(&scratch, &qemu, accel.qemu_name())
                    .map_err(bad)?;
                let sign = Signing {
                    signer: signer.as_deref(),
                    source: Some(&checked),
                };
                publish_scratch(&pool, &scratch, &dst, meta, tpl_name.clone(), sign)
            })();
            let _ = pool.trash(&scratch);
            done
        })
        .await
    }

    /// Removes a template. Idempotent.
    pub async fn delete_template(&self, tpl: &TemplateId) -> Result<()> {
        self.trash_if_exists(self.template_dir(tpl)).await?;
        self.remove_sidecar(StateRef::Template(tpl));
        Ok(())
    }

    /// Metadata of a template.
    pub fn template_meta(&self, tpl: &TemplateId) -> Result<StateMeta> {
        self.open_state(StateRef::Template(tpl)).map(|s| s.meta)
    }
}

/// Removes a scratch subvolume an interrupted operation left at `path`.
fn clear_scratch(pool: &strata_storage::Pool, path: &Path) -> Result<()> {
    if pool.is_subvolume(path).unwrap_or(false) {
        pool.delete_subvolume(path).map_err(storage_err)?;
    }
    Ok(())
}

/// How a published template is signed: by `signer` (none: not signed),
/// its `device.state` the same as the verified `source`'s.
struct Signing<'a> {
    signer: Option<&'a crate::signing::StateSigner>,
    source: Option<&'a StateHashes>,
}

/// Makes the state in `scratch` template `tpl` at `dst`: its `meta.json`
/// rewritten to name the template and no sandbox, signed, then one
/// read-only snapshot (the template exists whole or not at all). Returns
/// the meta.
fn publish_scratch(
    pool: &strata_storage::Pool,
    scratch: &Path,
    dst: &Path,
    meta: StateMeta,
    tpl: String,
    sign: Signing<'_>,
) -> Result<StateMeta> {
    let meta = StateMeta {
        sandbox: None,
        template: Some(tpl.clone()),
        written_at: Utc::now(),
        ..meta
    };
    meta.write(scratch)
        .map_err(|e| io_err("write meta.json", e))?;
    match std::fs::remove_file(scratch.join(files::EXPORT_RECORD)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(io_err("remove the cache record", e))
        }
        _ => {}
    }
    super::signatures::sign_into(sign.signer, scratch, &tpl, sign.source)?;
    pool.snapshot(scratch, dst, true).map_err(storage_err)?;
    Ok(meta)
}

/// A template cache entry's content record ([`files::EXPORT_RECORD`]):
/// the SHA-256 of the exported `meta.json` and `device.state`.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct ExportRecord {
    /// The exporting deployment's template id (informational).
    template: String,
    /// SHA-256 of `meta.json`, hex.
    meta_sha256: String,
    /// SHA-256 of `device.state`, hex; absent for a disk-only state.
    #[serde(default)]
    device_state_sha256: Option<String>,
}

impl ExportRecord {
    /// Records the state copied into `entry`.
    fn write(entry: &Path, template: &str) -> Result<()> {
        let (meta, bytes) =
            StateMeta::read_with_bytes(entry).map_err(|e| RuntimeError::SnapshotUnusable {
                id: template.to_owned(),
                reason: e.0,
            })?;
        let h = StateHashes::of(&bytes, meta.disk_only, entry)
            .map_err(|e| io_err("hash device.state", e))?;
        let rec = ExportRecord {
            template: template.to_owned(),
            meta_sha256: hex::encode(h.meta),
            device_state_sha256: h.device_state.map(hex::encode),
        };
        let text =
            serde_json::to_vec_pretty(&rec).map_err(|e| RuntimeError::Other(e.to_string()))?;
        std::fs::write(entry.join(files::EXPORT_RECORD), text)
            .map_err(|e| io_err("write the cache record", e))
    }

    /// Checks the entry copied into `dir` (its meta's bytes `meta_bytes`)
    /// against its record; returns its hashes.
    fn check(
        dir: &Path,
        meta_bytes: &[u8],
        disk_only: bool,
    ) -> std::result::Result<StateHashes, String> {
        let text = std::fs::read(dir.join(files::EXPORT_RECORD)).map_err(|e| {
            format!("no content record ({e}): an entry written before strata signed templates")
        })?;
        let rec: ExportRecord = serde_json::from_slice(&text)
            .map_err(|e| format!("content record is not valid: {e}"))?;
        let h = StateHashes::of(meta_bytes, disk_only, dir)
            .map_err(|e| format!("cannot hash device.state: {e}"))?;
        if rec.meta_sha256 != hex::encode(h.meta) {
            return Err("meta.json differs from its content record".into());
        }
        if rec.device_state_sha256 != h.device_state.map(hex::encode) {
            return Err("device.state differs from its content record".into());
        }
        Ok(h)
    }
}

/// Copies every regular file of a state directory (kernel, initrd, RAM,
/// disk, device state, meta) into `dst`, keeping holes.
fn copy_state_files(src: &Path, dst: &Path) -> Result<()> {
    let entries = std::fs::read_dir(src).map_err(|e| io_err("read state dir", e))?;
    for e in entries {
        let e = e.map_err(|e| io_err("read state dir", e))?;
        let ft = e.file_type().map_err(|e| io_err("stat state file", e))?;
        // A signature is one deployment's: never carried to another.
        if !ft.is_file() || e.file_name() == files::SIGNATURE {
            continue;
        }
        copy_sparse(&e.path(), &dst.join(e.file_name()))
            .map_err(|e| io_err("copy state file", e))?;
    }
    Ok(())
}

/// Copies a file keeping holes (reflink where the file systems allow).
fn copy_sparse(src: &Path, dst: &Path) -> std::io::Result<()> {
    let status = std::process::Command::new("cp")
        .arg("--reflink=auto")
        .arg("--sparse=always")
        .arg(src)
        .arg(dst)
        .status()?;
    if status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "cp {} {} failed ({status})",
            src.display(),
            dst.display()
        )))
    }
}

/// Grows a raw ext4 image to `bytes` (file and file system), offline.
fn grow_ext4(path: &Path, bytes: u64) -> Result<()> {
    let len = std::fs::metadata(path)
        .map_err(|e| io_err("stat disk", e))?
        .len();
    if bytes <= len {
        return Ok(());
    }
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| io_err("open disk", e))?;
    f.set_len(bytes).map_err(|e| io_err("grow disk", e))?;
    drop(f);
    let run = |prog: &str, args: &[&std::ffi::OsStr]| -> Result<()> {
        let out = std::process::Command::new(prog)
            .args(args)
            .output()
            .map_err(|e| io_err(format!("cannot run {prog} (install e2fsprogs)"), e))?;
        // e2fsck exits 1 when it fixed something harmless.
        if out.status.success() || (prog == "e2fsck" && out.status.code() == Some(1)) {
            Ok(())
        } else {
            Err(RuntimeError::Other(format!(
                "{prog} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            )))
        }
    };
    run("e2fsck", &["-fy".as_ref(), path.as_os_str()])?;
    run("resize2fs", &[path.as_os_str()])
}
