//! The schema: every migration since the first, applied in order at open
//! (`PRAGMA user_version` counts them). Never edit a shipped migration: add one.

/// Newest schema version this build knows.
pub const SCHEMA_VERSION: i64 = 17;

pub(super) const MIGRATIONS: &[&str] = &[
    // 1: initial schema.
    r#"
    CREATE TABLE sandboxes (
        id TEXT PRIMARY KEY,
        tenant_id TEXT NOT NULL DEFAULT 'default',
        template_id TEXT,
        source_snapshot_id TEXT,
        vcpus INTEGER NOT NULL,
        memory_mib INTEGER NOT NULL,
        disk_gib INTEGER NOT NULL,
        labels TEXT NOT NULL DEFAULT '{}',
        state TEXT NOT NULL,
        state_reason TEXT,
        pending_op TEXT,
        idle_timeout_s INTEGER,
        snapshot_interval_s INTEGER,
        created_at INTEGER NOT NULL,
        updated_at INTEGER NOT NULL,
        last_activity_at INTEGER NOT NULL,
        pid INTEGER,
        accel TEXT,
        deleted_at INTEGER
    ) WITHOUT ROWID;
    CREATE INDEX sandboxes_by_tenant ON sandboxes (tenant_id, created_at, id);
    CREATE INDEX sandboxes_by_state ON sandboxes (tenant_id, state, created_at, id);
    CREATE INDEX sandboxes_by_state_only ON sandboxes (state);
    CREATE TABLE sandbox_labels (
        sandbox_id TEXT NOT NULL,
        key TEXT NOT NULL,
        value TEXT NOT NULL,
        PRIMARY KEY (sandbox_id, key)
    ) WITHOUT ROWID;
    CREATE INDEX sandbox_labels_by_kv ON sandbox_labels (key, value, sandbox_id);
    CREATE TABLE snapshots (
        id TEXT PRIMARY KEY,
        tenant_id TEXT NOT NULL DEFAULT 'default',
        sandbox_id TEXT NOT NULL,
        kind TEXT NOT NULL,
        label TEXT,
        status TEXT NOT NULL,
        status_reason TEXT,
        created_at INTEGER NOT NULL,
        pause_ms REAL,
        exclusive_bytes INTEGER,
        referenced_bytes INTEGER
    ) WITHOUT ROWID;
    CREATE INDEX snapshots_by_sandbox ON snapshots (sandbox_id, created_at);
    CREATE INDEX snapshots_by_status ON snapshots (status, sandbox_id);
    CREATE TABLE templates (
        id TEXT PRIMARY KEY,
        tenant_id TEXT NOT NULL DEFAULT 'default',
        name TEXT,
        vcpus INTEGER NOT NULL,
        memory_mib INTEGER NOT NULL,
        disk_gib INTEGER NOT NULL,
        status TEXT NOT NULL,
        status_reason TEXT,
        accel TEXT,
        created_at INTEGER NOT NULL,
        updated_at INTEGER NOT NULL
    ) WITHOUT ROWID;
    CREATE TABLE events (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        at INTEGER NOT NULL,
        tenant_id TEXT NOT NULL DEFAULT 'default',
        sandbox_id TEXT NOT NULL,
        op TEXT NOT NULL,
        from_state TEXT,
        to_state TEXT,
        phase TEXT NOT NULL,
        detail TEXT
    );
    CREATE INDEX events_by_sandbox ON events (sandbox_id, seq);
    CREATE TRIGGER events_append_only_update BEFORE UPDATE ON events
        BEGIN SELECT RAISE(ABORT, 'events are append-only'); END;
    CREATE TRIGGER events_append_only_delete BEFORE DELETE ON events
        BEGIN SELECT RAISE(ABORT, 'events are append-only'); END;
    "#,
    // 2: tokens, tenants, policies, approvals, audit head (see `security::store`).
    crate::security::store::MIGRATION_V2,
    // 3: label rows carry their sandbox's tenant and creation time, so a
    // label filter walks one index in listing order instead of testing every
    // live sandbox of the tenant (1.8 s p99 at 1M records before, see
    // `strata-bench --only scale`).
    r#"
    ALTER TABLE sandbox_labels ADD COLUMN tenant_id TEXT NOT NULL DEFAULT '';
    ALTER TABLE sandbox_labels ADD COLUMN created_at INTEGER NOT NULL DEFAULT 0;
    UPDATE sandbox_labels SET
        tenant_id = (SELECT s.tenant_id FROM sandboxes s WHERE s.id = sandbox_labels.sandbox_id),
        created_at = (SELECT s.created_at FROM sandboxes s WHERE s.id = sandbox_labels.sandbox_id);
    CREATE INDEX sandbox_labels_in_order ON sandbox_labels (tenant_id, key, value, created_at, sandbox_id);
    "#,
    // 4: the default template belongs to the platform scope (shared by every
    // tenant, deletable by none); the E2B door's envd tokens are bound to
    // the caller they were handed to (see `security::store`).
    r#"
    UPDATE templates SET tenant_id = '@platform' WHERE id = 'tpl-default' AND tenant_id = 'default';
    CREATE TABLE envd_bindings (
        sandbox_id TEXT PRIMARY KEY,
        caller TEXT NOT NULL,
        updated_at INTEGER NOT NULL
    );
    "#,
    // 5: every sandbox update is a compare-and-set on its version.
    r#"
    ALTER TABLE sandboxes ADD COLUMN version INTEGER NOT NULL DEFAULT 0;
    "#,
    // 6: pool-bytes quotas: each snapshot's charge in its lineage (what it
    // holds that its base does not), computed once per base and cached.
    r#"
    CREATE TABLE snapshot_charges (
        snapshot_id TEXT PRIMARY KEY,
        tenant_id TEXT NOT NULL,
        sandbox_id TEXT NOT NULL,
        base TEXT NOT NULL,
        bytes INTEGER NOT NULL,
        computed_at INTEGER NOT NULL
    ) WITHOUT ROWID;
    CREATE INDEX snapshot_charges_by_tenant ON snapshot_charges (tenant_id, sandbox_id);
    CREATE INDEX snapshots_by_tenant_status ON snapshots (tenant_id, status, sandbox_id, created_at);
    "#,
    // 7: environment variables given at create (the E2B door's `envVars`),
    // kept with the sandbox and inherited by its forks; the row goes when
    // the sandbox is deleted. Written as plain JSON until the key store
    // came; now sealed (`sealed:v1:…`, security::keys), and the service
    // seals a plain row it reads.
    r#"
    CREATE TABLE sandbox_env (
        sandbox_id TEXT PRIMARY KEY,
        env TEXT NOT NULL,
        updated_at INTEGER NOT NULL
    ) WITHOUT ROWID;
    "#,
    // 8: a sandbox's lifecycle policy (what its idle timeout does, whether
    // guest traffic wakes it), kept with it and inherited by its forks; no
    // row = the default (hibernate, wake on use). The row goes when the
    // sandbox is deleted.
    r#"
    CREATE TABLE sandbox_lifecycle (
        sandbox_id TEXT PRIMARY KEY,
        on_timeout TEXT NOT NULL,
        auto_resume INTEGER NOT NULL,
        updated_at INTEGER NOT NULL
    ) WITHOUT ROWID;
    "#,
    // 9: a front door's per-sandbox settings by key (JSON; the E2B door's
    // port settings: public traffic, the Host a guest port sees), kept with
    // the sandbox and copied to its forks by the door; the rows go when the
    // sandbox is deleted.
    r#"
    CREATE TABLE sandbox_settings (
        sandbox_id TEXT NOT NULL,
        key TEXT NOT NULL,
        value TEXT NOT NULL,
        updated_at INTEGER NOT NULL,
        PRIMARY KEY (sandbox_id, key)
    ) WITHOUT ROWID;
    CREATE INDEX sandbox_settings_by_key ON sandbox_settings (key, sandbox_id);
    "#,
    // 10: size variants: a template made from another's disk booted at
    // another vCPU count and memory names the template it varies.
    r#"
    ALTER TABLE templates ADD COLUMN variant_of TEXT;
    CREATE INDEX templates_by_variant ON templates (variant_of);
    "#,
    // 11: a front door's per-tenant settings by key (JSON; the E2B door's
    // template tags of each name).
    r#"
    CREATE TABLE tenant_settings (
        tenant_id TEXT NOT NULL,
        key TEXT NOT NULL,
        value TEXT NOT NULL,
        updated_at INTEGER NOT NULL,
        PRIMARY KEY (tenant_id, key)
    ) WITHOUT ROWID;
    "#,
    // 12: a rolling snapshot of an unchanged guest names the snapshot it is
    // the same as (no subvolume of its own); NULL for every other one.
    r#"
    ALTER TABLE snapshots ADD COLUMN same_as TEXT;
    CREATE INDEX snapshots_by_same_as ON snapshots (same_as) WHERE same_as IS NOT NULL;
    "#,
    // 13: the E2B door's envd access tokens: random, one per sandbox and
    // credential (strata token id or E2B key id) that obtained it, stored as
    // the token's SHA-256 with the nonce it is derived from (under the
    // door's secret, which the database does not hold) and the caller it
    // acts as; the rows go when the sandbox is deleted. A sandbox with no
    // row still takes its legacy HMAC token (see `strata_e2b::auth`).
    r#"
    CREATE TABLE envd_tokens (
        token_hash TEXT PRIMARY KEY,
        sandbox_id TEXT NOT NULL,
        tenant_id TEXT NOT NULL,
        credential TEXT NOT NULL,
        caller TEXT NOT NULL,
        nonce TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        UNIQUE (sandbox_id, credential)
    );
    CREATE INDEX envd_tokens_by_credential ON envd_tokens (credential);
    "#,
    // 14: the journal carries more than sandbox transitions (snapshots
    // taken and pruned, approvals requested and answered, policy refusals:
    // `kind`, with their JSON `data`; a row from before is a `sandbox`
    // transition), read per tenant in order by the event stream; it is
    // pruned by age (`[events] keep`): a delete passes only inside the
    // pruning transaction (a row in `journal_pruning`); never an update. Webhooks per tenant (the signing secret sealed by the key
    // store) and their deliveries, queued durably with the event they carry.
    r#"
    ALTER TABLE events ADD COLUMN kind TEXT NOT NULL DEFAULT 'sandbox';
    ALTER TABLE events ADD COLUMN data TEXT;
    CREATE INDEX events_by_tenant ON events (tenant_id, seq);
    CREATE INDEX events_by_at ON events (at);
    DROP TRIGGER events_append_only_delete;
    CREATE TABLE journal_pruning (active INTEGER NOT NULL);
    CREATE TRIGGER events_append_only_delete BEFORE DELETE ON events
        WHEN NOT EXISTS (SELECT 1 FROM journal_pruning)
        BEGIN SELECT RAISE(ABORT, 'events are append-only (only retention prunes them)'); END;
    CREATE TABLE webhooks (
        id TEXT PRIMARY KEY,
        tenant_id TEXT NOT NULL,
        url TEXT NOT NULL,
        events TEXT NOT NULL,
        format TEXT NOT NULL,
        secret TEXT NOT NULL,
        created_by TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        deleted_at INTEGER
    ) WITHOUT ROWID;
    CREATE INDEX webhooks_by_tenant ON webhooks (tenant_id, created_at);
    CREATE TABLE webhook_deliveries (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        webhook_id TEXT NOT NULL,
        tenant_id TEXT NOT NULL,
        event_seq INTEGER NOT NULL,
        topic TEXT NOT NULL,
        event TEXT NOT NULL,
        status TEXT NOT NULL,
        attempts INTEGER NOT NULL DEFAULT 0,
        last_status INTEGER,
        last_error TEXT,
        next_attempt_at INTEGER,
        created_at INTEGER NOT NULL,
        updated_at INTEGER NOT NULL
    );
    CREATE INDEX webhook_deliveries_due ON webhook_deliveries (status, next_attempt_at);
    CREATE INDEX webhook_deliveries_by_webhook ON webhook_deliveries (webhook_id, id);
    CREATE INDEX webhook_deliveries_by_tenant ON webhook_deliveries (tenant_id, status);
    "#,
    // 15: connector secrets the egress proxy injects (security::secrets,
    // docs/secrets.md): per tenant and name, bound to a connector by name,
    // the injection rule as JSON (no secret in it), the secret material
    // sealed by the key store (bound to `<tenant>/<name>`).
    r#"
    CREATE TABLE connector_secrets (
        tenant_id TEXT NOT NULL,
        name TEXT NOT NULL,
        connector TEXT NOT NULL,
        kind TEXT NOT NULL,
        rule TEXT NOT NULL,
        sealed TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        updated_at INTEGER NOT NULL,
        updated_by TEXT,
        PRIMARY KEY (tenant_id, name)
    ) WITHOUT ROWID;
    "#,
    // 16: listing a tenant's sandboxes (`state != 'deleted'`, ordered by
    // (created_at, id), keyset cursor) walks an index of the live ones
    // only: with the whole-table index it stepped over every deleted
    // sandbox older than the page (a long-lived tenant's first page read
    // its whole history). It also serves the tenant's usage count. It
    // replaces `sandboxes_by_tenant`, which no query needs any more (a
    // listing of deleted ones goes by `sandboxes_by_state`).
    r#"
    CREATE INDEX sandboxes_live_by_tenant ON sandboxes (tenant_id, created_at, id)
        WHERE state != 'deleted';
    DROP INDEX sandboxes_by_tenant;
    "#,
    // 17: PostgreSQL's label rows carry their sandbox's whole record, so
    // its listing by label needs no lookup into `sandboxes` per row
    // (`postgres::schema::V17`). Nothing changes here: SQLite's listing by
    // label keeps the join (its `sandboxes` is clustered by id, one page
    // cache, no buffer manager in between); the number is taken so that one
    // number means one schema on both backends.
    r#"
    -- no change
    "#,
];
