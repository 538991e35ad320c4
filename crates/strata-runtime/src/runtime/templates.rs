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
            blocking(move || {
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
        if !src.exists() {
            return Err(RuntimeError::SnapshotNotFound(snap.to_string()));
        }
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
                publish_scratch(&pool, &scratch, &dst, meta, tpl_name).map(|_| ())
            })();
            let _ = pool.trash(&scratch);
            published
        })
        .await
    }

    /// Copies template `tpl`'s files (sparse) into the new directory
    /// `dest` (written as `dest.tmp-*` and renamed, so `dest` is whole or
    /// absent): a host-level cache entry another daemon can import.
    pub async fn export_template(&self, tpl: &TemplateId, dest: &Path) -> Result<()> {
        let src = self.template_dir(tpl);
        if !src.exists() {
            return Err(RuntimeError::SnapshotNotFound(tpl.to_string()));
        }
        let dest = dest.to_path_buf();
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
            let copied = copy_state_files(&src, &tmp);
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
    /// wrote (any daemon's): checked restorable on this host (QEMU series,
    /// accelerator, every file present) before it is published read-only,
    /// with its meta naming `tpl` and no sandbox.
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
        blocking(move || {
            clear_scratch(&pool, &scratch)?;
            pool.create_subvolume(&scratch).map_err(storage_err)?;
            let done = (|| {
                copy_state_files(&src, &scratch)?;
                let bad = |e: crate::meta::Incompatible| RuntimeError::SnapshotUnusable {
                    id: tpl_name.clone(),
                    reason: format!("cached template: {}", e.0),
                };
                let meta = StateMeta::read(&scratch).map_err(bad)?;
                meta.check_restorable(&scratch, &qemu, accel.qemu_name())
                    .map_err(bad)?;
                publish_scratch(&pool, &scratch, &dst, meta, tpl_name.clone())
            })();
            let _ = pool.trash(&scratch);
            done
        })
        .await
    }

    /// Removes a template. Idempotent.
    pub async fn delete_template(&self, tpl: &TemplateId) -> Result<()> {
        self.trash_if_exists(self.template_dir(tpl)).await
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

/// Makes the state in `scratch` template `tpl` at `dst`: its `meta.json`
/// rewritten to name the template and no sandbox, then one read-only
/// snapshot (the template exists whole or not at all). Returns the meta.
fn publish_scratch(
    pool: &strata_storage::Pool,
    scratch: &Path,
    dst: &Path,
    meta: StateMeta,
    tpl: String,
) -> Result<StateMeta> {
    let meta = StateMeta {
        sandbox: None,
        template: Some(tpl),
        written_at: Utc::now(),
        ..meta
    };
    meta.write(scratch)
        .map_err(|e| io_err("write meta.json", e))?;
    pool.snapshot(scratch, dst, true).map_err(storage_err)?;
    Ok(meta)
}

/// Copies every regular file of a state directory (kernel, initrd, RAM,
/// disk, device state, meta) into `dst`, keeping holes.
fn copy_state_files(src: &Path, dst: &Path) -> Result<()> {
    let entries = std::fs::read_dir(src).map_err(|e| io_err("read state dir", e))?;
    for e in entries {
        let e = e.map_err(|e| io_err("read state dir", e))?;
        let ft = e.file_type().map_err(|e| io_err("stat state file", e))?;
        if !ft.is_file() {
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
