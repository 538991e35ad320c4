//! [`HostStore`] on PostgreSQL (tables of cluster migration 1). Every time
//! is the database's clock (`clock_timestamp()`, in ms), never a host's.

use super::*;
use crate::store::hosts::*;

/// The database's clock now, ms since the epoch.
const NOW_MS: &str = "(extract(epoch from clock_timestamp()) * 1000)::bigint";

impl From<tokio_postgres::Error> for HostError {
    fn from(e: tokio_postgres::Error) -> Self {
        HostError::Store(pg_err(e))
    }
}

fn lease_of(r: &Row) -> HostResult<OwnerLease> {
    let id: String = r.try_get(0)?;
    Ok(OwnerLease {
        sandbox_id: id
            .parse()
            .map_err(|e| corrupt("sandbox_owners", &id, format!("{e}")))?,
        host_id: r.try_get(1)?,
        token: r.try_get::<_, i64>(2)?.max(0) as u64,
        expires_at: from_ms(r.try_get(3)?),
    })
}

const LEASE_COLS: &str = "sandbox_id, host_id, token, expires_at";

impl PgStore {
    /// [`PgStore::block`] for host calls.
    fn block_h<T>(&self, fut: impl Future<Output = HostResult<T>>) -> HostResult<T> {
        self.bounded(fut).unwrap_or_else(|| {
            self.pool.retain(|_, _| false);
            Err(self.no_answer().into())
        })
    }

    /// The leases `SELECT … FROM sandbox_owners WHERE {rest}` finds.
    fn leases_where(
        &self,
        rest: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> HostResult<Vec<OwnerLease>> {
        self.block_h(async {
            let c = self.client().await?;
            c.query(
                &format!("SELECT {LEASE_COLS} FROM sandbox_owners WHERE {rest}"),
                params,
            )
            .await?
            .iter()
            .map(lease_of)
            .collect()
        })
    }
}

impl HostStore for PgStore {
    fn add_template_holder(&self, template: &str, host: &str) -> HostResult<()> {
        self.block_h(async {
            let c = self.client().await?;
            c.execute(
                &format!(
                    "INSERT INTO template_holders (template_id, host_id, held_since) \
                     VALUES ($1, $2, {NOW_MS}) ON CONFLICT DO NOTHING"
                ),
                &[&template, &host],
            )
            .await?;
            Ok(())
        })
    }

    fn remove_template_holder(&self, template: &str, host: &str) -> HostResult<()> {
        self.block_h(async {
            let c = self.client().await?;
            c.execute(
                "DELETE FROM template_holders WHERE template_id = $1 AND host_id = $2",
                &[&template, &host],
            )
            .await?;
            Ok(())
        })
    }

    fn template_holders(&self, template: &str) -> HostResult<Vec<String>> {
        self.block_h(async {
            let c = self.client().await?;
            let rows = c
                .query(
                    "SELECT host_id FROM template_holders WHERE template_id = $1 ORDER BY host_id",
                    &[&template],
                )
                .await?;
            rows.iter()
                .map(|r| r.try_get::<_, String>(0).map_err(HostError::from))
                .collect()
        })
    }

    fn put_replica(&self, sandbox: &SandboxId, host: &str, snapshot: &str) -> HostResult<()> {
        self.block_h(async {
            let c = self.client().await?;
            c.execute(
                &format!(
                    "INSERT INTO sandbox_replicas (sandbox_id, host_id, snapshot_id, held_since) \
                     VALUES ($1, $2, $3, {NOW_MS}) ON CONFLICT (sandbox_id, host_id) \
                     DO UPDATE SET snapshot_id = EXCLUDED.snapshot_id, held_since = EXCLUDED.held_since"
                ),
                &[&sandbox.as_str(), &host, &snapshot],
            )
            .await?;
            Ok(())
        })
    }

    fn remove_replica(&self, sandbox: &SandboxId, host: &str) -> HostResult<()> {
        self.block_h(async {
            let c = self.client().await?;
            c.execute(
                "DELETE FROM sandbox_replicas WHERE sandbox_id = $1 AND host_id = $2",
                &[&sandbox.as_str(), &host],
            )
            .await?;
            Ok(())
        })
    }

    fn replicas(&self, sandbox: &SandboxId) -> HostResult<Vec<Replica>> {
        self.block_h(async {
            let c = self.client().await?;
            let rows = c
                .query(
                    "SELECT host_id, snapshot_id, held_since FROM sandbox_replicas \
                     WHERE sandbox_id = $1 ORDER BY host_id",
                    &[&sandbox.as_str()],
                )
                .await?;
            rows.iter()
                .map(|r| {
                    Ok(Replica {
                        host_id: r.try_get(0)?,
                        snapshot_id: r.try_get(1)?,
                        held_since: r.try_get(2)?,
                    })
                })
                .collect()
        })
    }

    fn host_replicas(&self, host: &str) -> HostResult<Vec<String>> {
        self.block_h(async {
            let c = self.client().await?;
            let rows = c
                .query(
                    "SELECT r.snapshot_id FROM sandbox_replicas r \
                     JOIN sandboxes s ON s.id = r.sandbox_id \
                     WHERE r.host_id = $1 AND s.state != 'deleted' ORDER BY r.snapshot_id",
                    &[&host],
                )
                .await?;
            rows.iter()
                .map(|r| r.try_get::<_, String>(0).map_err(HostError::from))
                .collect()
        })
    }

    fn deleted_replicas(&self, host: &str, limit: usize) -> HostResult<Vec<(String, String)>> {
        self.block_h(async {
            let c = self.client().await?;
            let rows = c
                .query(
                    "SELECT r.sandbox_id, r.snapshot_id FROM sandbox_replicas r \
                     LEFT JOIN sandboxes s ON s.id = r.sandbox_id \
                     WHERE r.host_id = $1 AND (s.id IS NULL OR s.state = 'deleted') \
                     ORDER BY r.held_since, r.sandbox_id LIMIT $2",
                    &[&host, &(limit.min(i64::MAX as usize) as i64)],
                )
                .await?;
            rows.iter()
                .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
                .collect()
        })
    }

    fn register_host(&self, h: &HostInfo, ttl_ms: u64) -> HostResult<HostLease> {
        self.block_h(async {
            let c = self.client().await?;
            let r = c
                .query_one(
                    &format!(
                        "INSERT INTO hosts (id, address, accel, qemu_version, cpu_model, \
                         capacity_vcpus, capacity_memory_mib, capacity_pool_bytes, epoch, \
                         registered_at, heartbeat_at, lease_until) \
                         VALUES ($1,$2,$3,$4,$5,$6,$7,$8,1,{NOW_MS},{NOW_MS},{NOW_MS} + $9) \
                         ON CONFLICT (id) DO UPDATE SET address = EXCLUDED.address, \
                         accel = EXCLUDED.accel, qemu_version = EXCLUDED.qemu_version, \
                         cpu_model = EXCLUDED.cpu_model, capacity_vcpus = EXCLUDED.capacity_vcpus, \
                         capacity_memory_mib = EXCLUDED.capacity_memory_mib, \
                         capacity_pool_bytes = EXCLUDED.capacity_pool_bytes, \
                         epoch = hosts.epoch + 1, registered_at = EXCLUDED.registered_at, \
                         heartbeat_at = EXCLUDED.heartbeat_at, lease_until = EXCLUDED.lease_until \
                         RETURNING epoch, lease_until"
                    ),
                    &[
                        &h.id,
                        &h.address,
                        &h.accel,
                        &h.qemu_version,
                        &h.cpu_model,
                        &i64_of(h.capacity.vcpus),
                        &i64_of(h.capacity.memory_mib),
                        &i64_of(h.capacity.pool_bytes),
                        &i64_of(ttl_ms),
                    ],
                )
                .await?;
            Ok(HostLease {
                epoch: r.try_get::<_, i64>(0)?.max(0) as u64,
                until: from_ms(r.try_get(1)?),
            })
        })
    }

    fn heartbeat(
        &self,
        id: &str,
        epoch: u64,
        free: &HostLoad,
        ttl_ms: u64,
    ) -> HostResult<HostLease> {
        self.block_h(async {
            let c = self.client().await?;
            let r = c
                .query_opt(
                    &format!(
                        "UPDATE hosts SET heartbeat_at = {NOW_MS}, lease_until = {NOW_MS} + $3, \
                         free_vcpus = $4, free_memory_mib = $5, free_pool_bytes = $6 \
                         WHERE id = $1 AND epoch = $2 RETURNING epoch, lease_until"
                    ),
                    &[
                        &id,
                        &i64_of(epoch),
                        &i64_of(ttl_ms),
                        &i64_of(free.vcpus),
                        &i64_of(free.memory_mib),
                        &i64_of(free.pool_bytes),
                    ],
                )
                .await?;
            match r {
                Some(r) => Ok(HostLease {
                    epoch: r.try_get::<_, i64>(0)?.max(0) as u64,
                    until: from_ms(r.try_get(1)?),
                }),
                None => Err(HostError::NotRegistered {
                    host: id.to_owned(),
                    epoch,
                }),
            }
        })
    }

    fn hosts(&self) -> HostResult<Vec<HostRecord>> {
        self.block_h(async {
            let c = self.client().await?;
            let rows = c
                .query(
                    &format!(
                        "SELECT id, address, accel, qemu_version, cpu_model, capacity_vcpus, \
                         capacity_memory_mib, capacity_pool_bytes, free_vcpus, free_memory_mib, \
                         free_pool_bytes, epoch, heartbeat_at, lease_until, \
                         lease_until > {NOW_MS} FROM hosts ORDER BY id"
                    ),
                    &[],
                )
                .await?;
            let u = |r: &Row, i: usize| -> HostResult<u64> {
                Ok(r.try_get::<_, i64>(i)?.max(0) as u64)
            };
            rows.iter()
                .map(|r| {
                    Ok(HostRecord {
                        info: HostInfo {
                            id: r.try_get(0)?,
                            address: r.try_get(1)?,
                            accel: r.try_get(2)?,
                            qemu_version: r.try_get(3)?,
                            cpu_model: r.try_get(4)?,
                            capacity: HostLoad {
                                vcpus: u(r, 5)?,
                                memory_mib: u(r, 6)?,
                                pool_bytes: u(r, 7)?,
                            },
                        },
                        free: HostLoad {
                            vcpus: u(r, 8)?,
                            memory_mib: u(r, 9)?,
                            pool_bytes: u(r, 10)?,
                        },
                        epoch: u(r, 11)?,
                        heartbeat_at: from_ms(r.try_get(12)?),
                        lease_until: from_ms(r.try_get(13)?),
                        alive: r.try_get(14)?,
                    })
                })
                .collect()
        })
    }

    fn acquire_sandbox(
        &self,
        sandbox: &SandboxId,
        host: &str,
        ttl_ms: u64,
        margin_ms: u64,
    ) -> HostResult<OwnerLease> {
        let ttl = i64_of(ttl_ms);
        let margin = i64_of(margin_ms);
        self.block_h(async {
            let mut c = self.client().await?;
            let tx = c.transaction().await?;
            let id = sandbox.as_str();
            // A free sandbox: the first to insert gets it.
            let granted = tx
                .query_opt(
                    &format!(
                        "INSERT INTO sandbox_owners (sandbox_id, host_id, token, acquired_at, expires_at) \
                         VALUES ($1, $2, nextval('strata_fencing_tokens'), {NOW_MS}, {NOW_MS} + $3) \
                         ON CONFLICT (sandbox_id) DO NOTHING RETURNING {LEASE_COLS}"
                    ),
                    &[&id, &host, &ttl],
                )
                .await?;
            if let Some(r) = granted {
                let lease = lease_of(&r)?;
                tx.commit().await?;
                return Ok(lease);
            }
            // Held: locked until this transaction ends.
            let r = tx
                .query_one(
                    &format!(
                        "SELECT {LEASE_COLS}, expires_at > {NOW_MS}, expires_at + $2 <= {NOW_MS} \
                         FROM sandbox_owners WHERE sandbox_id = $1 FOR UPDATE"
                    ),
                    &[&id, &margin],
                )
                .await?;
            let cur = lease_of(&r)?;
            let (live, takeable): (bool, bool) = (r.try_get(4)?, r.try_get(5)?);
            let sql = if cur.host_id == host && live {
                // The holder renews: same token.
                format!(
                    "UPDATE sandbox_owners SET expires_at = {NOW_MS} + $2 \
                     WHERE sandbox_id = $1 RETURNING {LEASE_COLS}"
                )
            } else if cur.host_id == host || takeable {
                // Expired (its own, or another's past the margin): a new
                // token, which fences every write of the old one.
                format!(
                    "UPDATE sandbox_owners SET host_id = $3, token = nextval('strata_fencing_tokens'), \
                     acquired_at = {NOW_MS}, expires_at = {NOW_MS} + $2 \
                     WHERE sandbox_id = $1 RETURNING {LEASE_COLS}"
                )
            } else {
                return Err(HostError::Owned {
                    sandbox: id.to_owned(),
                    owner: cur.host_id,
                    until: cur.expires_at,
                });
            };
            let args: Vec<&(dyn ToSql + Sync)> = if sql.contains("$3") {
                vec![&id, &ttl, &host]
            } else {
                vec![&id, &ttl]
            };
            let r = tx.query_one(&sql, &args).await?;
            let lease = lease_of(&r)?;
            tx.commit().await?;
            Ok(lease)
        })
    }

    fn renew_sandbox(
        &self,
        sandbox: &SandboxId,
        fence: &Fence,
        ttl_ms: u64,
    ) -> HostResult<OwnerLease> {
        self.block_h(async {
            let c = self.client().await?;
            let r = c
                .query_opt(
                    &format!(
                        "UPDATE sandbox_owners SET expires_at = {NOW_MS} + $4 \
                         WHERE sandbox_id = $1 AND host_id = $2 AND token = $3 \
                         AND expires_at > {NOW_MS} RETURNING {LEASE_COLS}"
                    ),
                    &[
                        &sandbox.as_str(),
                        &fence.host_id,
                        &i64_of(fence.token),
                        &i64_of(ttl_ms),
                    ],
                )
                .await?;
            match r {
                Some(r) => lease_of(&r),
                None => Err(HostError::Fenced {
                    sandbox: sandbox.to_string(),
                    host: fence.host_id.clone(),
                    token: fence.token,
                }),
            }
        })
    }

    fn hand_over_sandbox(
        &self,
        sandbox: &SandboxId,
        fence: &Fence,
        to: &str,
        ttl_ms: u64,
    ) -> HostResult<OwnerLease> {
        self.block_h(async {
            let c = self.client().await?;
            let r = c
                .query_opt(
                    &format!(
                        "UPDATE sandbox_owners SET host_id = $4, \
                         token = nextval('strata_fencing_tokens'), \
                         acquired_at = {NOW_MS}, expires_at = {NOW_MS} + $5 \
                         WHERE sandbox_id = $1 AND host_id = $2 AND token = $3 \
                         AND expires_at > {NOW_MS} \
                         AND EXISTS (SELECT 1 FROM hosts WHERE id = $4 AND lease_until > {NOW_MS}) \
                         RETURNING {LEASE_COLS}"
                    ),
                    &[
                        &sandbox.as_str(),
                        &fence.host_id,
                        &i64_of(fence.token),
                        &to,
                        &i64_of(ttl_ms),
                    ],
                )
                .await?;
            match r {
                Some(r) => lease_of(&r),
                None => Err(HostError::Fenced {
                    sandbox: sandbox.to_string(),
                    host: fence.host_id.clone(),
                    token: fence.token,
                }),
            }
        })
    }

    fn release_sandbox(&self, sandbox: &SandboxId, fence: &Fence) -> HostResult<bool> {
        self.block_h(async {
            let c = self.client().await?;
            let n = c
                .execute(
                    "DELETE FROM sandbox_owners WHERE sandbox_id = $1 AND host_id = $2 AND token = $3",
                    &[&sandbox.as_str(), &fence.host_id, &i64_of(fence.token)],
                )
                .await?;
            Ok(n > 0)
        })
    }

    fn host_leases(&self, host: &str) -> HostResult<Vec<OwnerLease>> {
        self.leases_where("host_id = $1 ORDER BY sandbox_id", &[&host])
    }

    fn expired_leases(
        &self,
        except: &str,
        margin_ms: u64,
        limit: usize,
    ) -> HostResult<Vec<OwnerLease>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.leases_where(
            &format!("expires_at + $2 <= {NOW_MS} AND host_id <> $1 ORDER BY expires_at LIMIT $3"),
            &[&except, &i64_of(margin_ms), &limit],
        )
    }

    fn unrenewed_leases(
        &self,
        host: &str,
        within_ms: u64,
        limit: usize,
    ) -> HostResult<Vec<OwnerLease>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        // A range of `sandbox_owners_by_expiry`: held leases of every host
        // are renewed to `now + ttl`, outside the window.
        self.leases_where(
            &format!(
                "expires_at > {NOW_MS} AND expires_at <= {NOW_MS} + $2 \
                 AND host_id = $1 ORDER BY expires_at LIMIT $3"
            ),
            &[&host, &i64_of(within_ms), &limit],
        )
    }

    fn sandbox_owner(&self, sandbox: &SandboxId) -> HostResult<Option<OwnerLease>> {
        self.block_h(async {
            let c = self.client().await?;
            c.query_opt(
                &format!("SELECT {LEASE_COLS} FROM sandbox_owners WHERE sandbox_id = $1"),
                &[&sandbox.as_str()],
            )
            .await?
            .as_ref()
            .map(lease_of)
            .transpose()
        })
    }

    fn commit_fenced(
        &self,
        fence: &Fence,
        sandboxes: &[&SandboxRecord],
        snapshots: &[&SnapshotRecord],
        event: Option<&Event>,
    ) -> HostResult<()> {
        let tokens = sandboxes
            .iter()
            .map(|s| s.id.as_str())
            .chain(snapshots.iter().map(|s| s.sandbox_id.as_str()))
            .chain(event.map(|e| e.sandbox_id.as_str()))
            .map(|id| (id.to_owned(), fence.token))
            .collect();
        self.commit_fenced_each(&fence.host_id, &tokens, sandboxes, snapshots, event)
    }

    fn commit_fenced_each(
        &self,
        host_id: &str,
        tokens: &std::collections::BTreeMap<String, u64>,
        sandboxes: &[&SandboxRecord],
        snapshots: &[&SnapshotRecord],
        event: Option<&Event>,
    ) -> HostResult<()> {
        let limit = self.delivery_limit.load(Ordering::Relaxed);
        let mut ids: Vec<&str> = sandboxes
            .iter()
            .map(|s| s.id.as_str())
            .chain(snapshots.iter().map(|s| s.sandbox_id.as_str()))
            .chain(event.map(|e| e.sandbox_id.as_str()))
            .collect();
        ids.sort_unstable();
        ids.dedup();
        let journaled = event.is_some() || !snapshots.is_empty();
        self.block_h(async {
            let mut c = self.client().await?;
            let tx = c.transaction().await?;
            for id in &ids {
                let fenced = |token: u64| HostError::Fenced {
                    sandbox: (*id).to_owned(),
                    host: host_id.to_owned(),
                    token,
                };
                let Some(&token) = tokens.get(*id) else {
                    return Err(fenced(0));
                };
                // FOR SHARE: a takeover (an UPDATE of the row) waits for
                // this write to commit, and this write sees a takeover
                // that committed first.
                let ok = tx
                    .query_opt(
                        &format!(
                            "SELECT 1 FROM sandbox_owners WHERE sandbox_id = $1 AND host_id = $2 \
                             AND token = $3 AND expires_at > {NOW_MS} FOR SHARE"
                        ),
                        &[id, &host_id, &i64_of(token)],
                    )
                    .await?;
                if ok.is_none() {
                    return Err(fenced(token));
                }
            }
            write_all(&*tx, sandboxes, snapshots, event, limit).await?;
            tx.commit().await?;
            Ok(())
        })?;
        if journaled {
            self.changed();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
