// The console's pages. Each takes the context ({me, main, go, error}) and
// an argument from the URL, draws its frame into `main` and returns
// {refresh}, called on sign-in, on every event of the stream and every 2 s
// while polling. A page redraws a part only when its data changed (so a
// reason being typed or a dialog open survives updates). Every string from
// the API is put in the page as text (dom.js), never as markup.
import { api, ApiError } from "./api.js";
import { h, s, put, ago, bytes, when } from "./dom.js";
import { terminalPanel } from "./terminal.js";

const ANSWERS = ["admin", "approver"];
const DEVELOPS = ["admin", "developer"];

/** Redraws `el` with `draw(data)` when `data` differs from the last drawing. */
function drawer(el, draw) {
  let last;
  return (data) => {
    const key = JSON.stringify(data);
    if (key === last) return;
    last = key;
    put(el, draw(data));
  };
}

function table(cols, rows, attrs) {
  return h("table", attrs || {},
    h("thead", {}, h("tr", {}, cols.map((c) => h("th", {}, c)))),
    h("tbody", {}, rows));
}

function labels(obj) {
  return Object.entries(obj || {}).map(([k, v]) => h("span", { class: "chip" }, `${k}=${v}`));
}

function size(sz) {
  if (!sz) return "";
  return `${sz.vcpus} vCPU · ${sz.memory_mib} MiB · ${sz.disk_gib} GiB`;
}

function stateTag(st) {
  return h("span", { class: `state state-${st}` }, st);
}

/** A confirmation in the page's <dialog>; resolves true when confirmed. */
function confirmDialog(title, text, ok) {
  const d = document.getElementById("confirm");
  document.getElementById("confirm-title").textContent = title;
  document.getElementById("confirm-text").textContent = text;
  document.getElementById("confirm-ok").textContent = ok;
  d.returnValue = "";
  d.showModal();
  return new Promise((resolve) => {
    d.addEventListener("close", () => resolve(d.returnValue === "ok"), { once: true });
  });
}

function section(title, ...children) {
  return h("section", { class: "card" }, h("h2", {}, title), children);
}

// ------------------------------------------------------------ sandboxes

export function sandboxes(ctx) {
  const body = h("div", { id: "sandboxes" });
  put(ctx.main, h("h1", {}, "Sandboxes"), body);
  const draw = drawer(body, (items) => items.length === 0
    ? h("p", { class: "muted" }, "No sandboxes in this tenant.")
    : table(["Sandbox", "State", "Size", "Labels", "Template", "Age"], items.map((sb) =>
      h("tr", { "data-id": sb.id },
        h("td", {}, h("a", { href: `#/sandbox/${encodeURIComponent(sb.id)}` }, sb.id)),
        h("td", {}, stateTag(sb.state), sb.pending_op ? h("span", { class: "muted" }, ` (${sb.pending_op})`) : ""),
        h("td", {}, size(sb.size)),
        h("td", {}, labels(sb.labels)),
        h("td", {}, sb.template || sb.source_snapshot || ""),
        h("td", { title: sb.created_at }, ago(sb.created_at))))));
  return {
    async refresh() {
      const r = await api("GET", "/v1/sandboxes?limit=200");
      // Age changes every second: draw on a minute's resolution.
      draw((r.body.items || []).map((sb) => ({ ...sb, _age: ago(sb.created_at) })));
    },
  };
}

// ------------------------------------------------------------ one sandbox

function pauseMs(v) {
  return v === null || v === undefined ? "–" : `${Number(v).toFixed(1)} ms`;
}

const KINDS = ["manual", "rolling", "pre_rewind", "rewind", "hibernate", "fork", "template"];

function timeline(sb, snaps, selected, onPick) {
  const W = 960, H = 40 + KINDS.length * 22, L = 90, R = 20;
  // From the first snapshot (a margin before it) to now: a sandbox lives
  // for weeks, its snapshots are what the axis is for.
  const times = snaps.map((x) => Date.parse(x.created_at));
  const born = Date.parse(sb.created_at);
  const first = times.length ? Math.min(...times) : born;
  const t1 = Math.max(Date.now(), ...times);
  const span = Math.max(t1 - first, 10000);
  const t0 = Math.max(Math.min(born, first), first - span * 0.1);
  const x = (t) => L + ((t - t0) / (t1 - t0)) * (W - L - R);
  const y = (k) => 20 + Math.max(0, KINDS.indexOf(k)) * 22;
  const kids = [];
  for (const k of KINDS) {
    kids.push(s("text", { x: 4, y: y(k) + 4, class: "lane" }, k));
    kids.push(s("line", { x1: L, x2: W - R, y1: y(k), y2: y(k), class: "lane-line" }));
  }
  const axisY = H - 14;
  kids.push(s("line", { x1: L, x2: W - R, y1: axisY - 8, y2: axisY - 8, class: "axis" }));
  for (let i = 0; i <= 4; i++) {
    const t = t0 + ((t1 - t0) * i) / 4;
    kids.push(s("text", { x: x(t), y: axisY + 4, class: "tick", "text-anchor": i === 0 ? "start" : i === 4 ? "end" : "middle" },
      new Date(t).toLocaleTimeString()));
  }
  if (born >= t0) {
    kids.push(s("line", { x1: x(born), x2: x(born), y1: 10, y2: axisY - 8, class: "born" }));
    kids.push(s("text", { x: x(born) + 3, y: 10, class: "tick" }, "created"));
  }
  for (const sn of snaps) {
    const r = 4 + Math.min(8, Math.log2(1 + (sn.exclusive_bytes || 0) / 65536));
    const tip = `${sn.kind}${sn.label ? " “" + sn.label + "”" : ""} · ${when(sn.created_at)} · pause ${pauseMs(sn.pause_ms)} · exclusive ${bytes(sn.exclusive_bytes)}${sn.same_as ? " · same as " + sn.same_as : ""}`;
    kids.push(s("circle", {
      cx: x(Date.parse(sn.created_at)), cy: y(sn.kind), r,
      class: `snap kind-${sn.kind}${sn.id === selected ? " selected" : ""}${sn.status !== "ready" ? " not-ready" : ""}`,
      "data-id": sn.id, tabindex: 0, role: "button", "aria-label": tip,
      on: { click: () => onPick(sn.id), keydown: (e) => { if (e.key === "Enter") onPick(sn.id); } },
    }, s("title", {}, tip)));
  }
  return s("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, class: "timeline", id: "timeline", role: "img", "aria-label": "snapshot timeline" }, kids);
}

export function sandbox(ctx, id) {
  const head = h("div", { id: "sandbox-head" });
  const tl = h("div", { id: "timeline-box" });
  const pick = h("div", { id: "snapshot-detail" });
  const evs = h("div", { id: "events" });
  const aud = h("div", { id: "sandbox-audit" });
  const note = h("p", { id: "action-result", class: "muted" });
  put(ctx.main,
    h("p", {}, h("a", { href: "#/sandboxes" }, "← Sandboxes")),
    head,
    section("Snapshot timeline", tl, pick, note),
    section("Terminal", terminalPanel(ctx.me.role, id)),
    section("Recent events", evs),
    section("Audit entries", aud));
  let selected = null;
  let data = null;
  const canAct = DEVELOPS.includes(ctx.me.role);
  const drawHead = drawer(head, (sb) => h("div", {},
    h("h1", {}, "Sandbox ", h("code", {}, sb.id)),
    h("p", {}, stateTag(sb.state), " · ", size(sb.size), " · created ", when(sb.created_at),
      sb.template ? ` · template ${sb.template}` : "", " ", labels(sb.labels)),
    sb.state_reason ? h("p", { class: "muted" }, sb.state_reason) : ""));
  const drawTl = drawer(tl, ({ sb, snaps, sel }) => snaps.length
    ? timeline(sb, snaps, sel, (sid) => { selected = sid; redraw(); })
    : h("p", { class: "muted" }, "No snapshots yet."));
  const drawPick = drawer(pick, ({ sn }) => {
    if (!sn) return h("p", { class: "muted" }, "Select a snapshot on the timeline.");
    return h("div", { class: "detail" },
      h("dl", {},
        h("dt", {}, "Snapshot"), h("dd", {}, h("code", {}, sn.id)),
        h("dt", {}, "Kind"), h("dd", {}, sn.kind),
        sn.label ? [h("dt", {}, "Label"), h("dd", {}, sn.label)] : "",
        h("dt", {}, "Taken"), h("dd", {}, when(sn.created_at)),
        h("dt", {}, "Pause"), h("dd", {}, pauseMs(sn.pause_ms)),
        h("dt", {}, "Exclusive bytes"), h("dd", {}, bytes(sn.exclusive_bytes)),
        h("dt", {}, "Status"), h("dd", {}, sn.status)),
      canAct ? h("div", { class: "actions" },
        h("button", { type: "button", id: "rewind", class: "danger", on: { click: () => rewind(sn) } }, "Rewind to this snapshot"),
        h("button", { type: "button", id: "fork", on: { click: () => fork(sn) } }, "Fork from this snapshot"))
        : h("p", { class: "muted" }, `Your role (${ctx.me.role}) cannot rewind or fork.`));
  });
  const drawEvents = drawer(evs, (items) => items.length === 0 ? h("p", { class: "muted" }, "No events.")
    : table(["#", "When", "Operation", "State", "Phase", "Detail"], items.map((e) =>
      h("tr", {}, h("td", {}, e.seq), h("td", { title: e.at }, when(e.at)), h("td", {}, e.op),
        h("td", {}, `${e.from_state || ""} → ${e.to_state || ""}`), h("td", {}, e.phase), h("td", {}, e.detail || "")))));
  const drawAudit = drawer(aud, (items) => auditTable(items));

  function redraw() {
    if (!data) return;
    const sn = data.snaps.find((x) => x.id === selected);
    drawTl({ sb: data.sb, snaps: data.snaps, sel: selected });
    drawPick({ sn });
  }

  async function act(what, path, body) {
    note.textContent = `${what}…`;
    try {
      const r = await api("POST", `${path}?wait=false`, body);
      if (r.status === 202) {
        note.textContent = `${what}: held for approval ${r.body.approval && r.body.approval.id} (see Approvals).`;
        return null;
      }
      note.textContent = `${what}: done.`;
      return r.body;
    } catch (e) {
      note.textContent = e instanceof ApiError ? `${what} failed: ${e.code}: ${e.message}` : String(e);
      return null;
    } finally {
      await page.refresh().catch(() => {});
    }
  }
  async function rewind(sn) {
    const ok = await confirmDialog("Rewind sandbox?",
      `Rewind ${id} to the ${sn.kind} snapshot ${sn.id} taken ${when(sn.created_at)}? The guest restarts from that moment; its present state is kept as a pre_rewind snapshot.`,
      "Rewind");
    if (ok) await act("Rewind", `/v1/sandboxes/${encodeURIComponent(id)}/rewind`, { to: sn.id });
  }
  async function fork(sn) {
    const ok = await confirmDialog("Fork a new sandbox?",
      `Start a new sandbox from snapshot ${sn.id} (${sn.kind}, ${when(sn.created_at)})? ${id} is not changed.`, "Fork");
    if (!ok) return;
    const made = await act("Fork", `/v1/snapshots/${encodeURIComponent(sn.id)}/fork`, {});
    if (made && made.id) ctx.go(`#/sandbox/${encodeURIComponent(made.id)}`);
  }

  const page = {
    async refresh() {
      const p = encodeURIComponent(id);
      const [sb, snaps, events, audit] = await Promise.all([
        api("GET", `/v1/sandboxes/${p}`),
        api("GET", `/v1/sandboxes/${p}/snapshots`),
        api("GET", `/v1/sandboxes/${p}/events`).catch(() => ({ body: { items: [] } })),
        api("GET", `/v1/audit?sandbox=${p}`, undefined, { ndjson: true }).catch(() => ({ body: [] })),
      ]);
      data = { sb: sb.body, snaps: (snaps.body.items || []).filter((x) => x.status !== "deleted") };
      data.snaps.sort((a, b) => Date.parse(a.created_at) - Date.parse(b.created_at));
      drawHead(sb.body);
      redraw();
      drawEvents((events.body.items || []).slice(-50).reverse());
      drawAudit(audit.body.slice(-15).reverse());
    },
  };
  return page;
}

// ------------------------------------------------------------ approvals

function callDetails(call) {
  const k = call.kind || {};
  const rows = [];
  for (const [key, v] of Object.entries(k)) {
    if (key === "kind" || v === null || v === undefined) continue;
    let val;
    if (key === "argv" && Array.isArray(v)) {
      val = h("span", { class: "argv" }, v.map((a) => h("code", { class: "arg" }, a)));
    } else if (typeof v === "string" || typeof v === "number" || typeof v === "boolean") {
      val = h("code", {}, String(v));
    } else {
      val = h("code", {}, JSON.stringify(v));
    }
    rows.push(h("dt", {}, key), h("dd", { "data-field": key }, val));
  }
  return rows;
}

export function approvals(ctx, focus) {
  const pending = h("div", { id: "pending" });
  const done = h("div", { id: "answered" });
  const answers = ANSWERS.includes(ctx.me.role);
  put(ctx.main, h("h1", {}, "Approvals"),
    answers ? "" : h("p", { class: "notice", id: "cannot-answer" }, `Your role (${ctx.me.role}) can see held calls but not answer them.`),
    section("Waiting for an answer", pending),
    section("Answered recently", done));
  const reasons = new Map();
  const drawPending = drawer(pending, (items) => items.length === 0
    ? h("p", { class: "muted" }, "Nothing is waiting.")
    : items.map((a) => {
      const reason = h("input", { type: "text", class: "reason", placeholder: "reason (optional)", value: reasons.get(a.id) || "", maxlength: 500,
        on: { input: (e) => reasons.set(a.id, e.target.value) } });
      const answer = async (yes) => {
        try {
          const text = reason.value.trim();
          await api("POST", `/v1/approvals/${encodeURIComponent(a.id)}/${yes ? "approve" : "deny"}`, text ? { reason: text } : undefined);
          reasons.delete(a.id);
        } catch (e) { ctx.error(e); }
        await page.refresh();
      };
      return h("article", { class: `approval card${a.id === focus ? " focus" : ""}`, "data-id": a.id },
        h("h3", {}, h("span", { class: "call-kind" }, (a.call.kind || {}).kind || "call"),
          a.sandbox ? [" in ", h("a", { href: `#/sandbox/${encodeURIComponent(a.sandbox)}` }, a.sandbox)] : ""),
        h("dl", {},
          callDetails(a.call),
          h("dt", {}, "requested by"), h("dd", { "data-field": "requested_by" }, a.requested_by),
          h("dt", {}, "rule"), h("dd", {}, a.rule_id),
          h("dt", {}, "why held"), h("dd", { "data-field": "reason" }, a.reason),
          a.body ? [h("dt", {}, "body"), h("dd", {}, `${bytes(a.body.bytes ?? a.body.size)} sha256 ${a.body.sha256 || ""}`)] : "",
          h("dt", {}, "held"), h("dd", { title: a.created_at }, ago(a.created_at)),
          a.expires_at ? [h("dt", {}, "expires"), h("dd", {}, when(a.expires_at))] : "",
          h("dt", {}, "id"), h("dd", {}, h("code", {}, a.id))),
        answers ? h("div", { class: "actions" }, reason,
          h("button", { type: "button", class: "approve", on: { click: () => answer(true) } }, "Approve"),
          h("button", { type: "button", class: "deny danger", on: { click: () => answer(false) } }, "Deny")) : "");
    }));
  const drawDone = drawer(done, (items) => items.length === 0 ? h("p", { class: "muted" }, "None.")
    : table(["When", "Call", "Sandbox", "Requested by", "Answer", "By"], items.map((a) => {
      const st = a.status || {};
      return h("tr", { "data-id": a.id }, h("td", {}, when(st.at || a.created_at)),
        h("td", {}, (a.call.kind || {}).kind, " ", h("code", {}, JSON.stringify(a.call.kind))),
        h("td", {}, a.sandbox || ""), h("td", {}, a.requested_by),
        h("td", {}, h("span", { class: `answer answer-${st.status}` }, st.status || "")),
        h("td", {}, st.by || "", st.reason ? ` — ${st.reason}` : ""));
    })));
  const page = {
    async refresh() {
      const all = (await api("GET", "/v1/approvals?status=all")).body.items || [];
      const isPending = (a) => (a.status || {}).status === "pending" || a.status === "pending";
      drawPending(all.filter(isPending));
      drawDone(all.filter((a) => !isPending(a)).slice(-20).reverse());
    },
  };
  return page;
}

// ------------------------------------------------------------ audit

function auditTable(items) {
  if (items.length === 0) return h("p", { class: "muted" }, "No entries.");
  return table(["#", "When", "Actor", "Call", "Sandbox", "Effect", "Outcome", "Rule", "By"], items.map((e) => {
    const d = e.decision || {};
    const k = (e.call && e.call.kind) || {};
    return h("tr", { "data-seq": e.seq },
      h("td", {}, e.seq), h("td", { title: e.time }, when(e.time)), h("td", {}, e.actor),
      h("td", {}, k.kind || "", " ", h("code", { class: "call" }, JSON.stringify(k))),
      h("td", {}, e.sandbox || ""), h("td", {}, d.effect || ""), h("td", {}, d.outcome || ""),
      h("td", { title: d.reason || "" }, d.rule_id || ""), h("td", {}, e.by || ""));
  }));
}

export function audit(ctx) {
  const verdict = h("div", { id: "verify" });
  const list = h("div", { id: "audit" });
  put(ctx.main, h("h1", {}, "Audit log"), section("Chain verification", verdict), section("Newest entries", list));
  const drawList = drawer(list, (items) => auditTable(items));
  const drawVerdict = drawer(verdict, (v) => {
    if (v.forbidden) return h("p", { class: "muted" }, "Verifying the chain needs an admin token (only the daemon holds its key).");
    if (v.ok) {
      return h("p", { class: "ok", id: "verify-ok" }, `✓ The chain verifies: ${v.entries} entries${v.keyed ? ", keyed" : ""}; this tenant's ${v.tenant_entries ?? 0} entries (seq ${v.tenant_first_seq ?? "–"}–${v.tenant_last_seq ?? "–"}).`);
    }
    return h("p", { class: "error", id: "verify-broken" }, `✗ The chain does not verify: ${v.error || v.message || JSON.stringify(v)}`);
  });
  return {
    async refresh() {
      const [entries, v] = await Promise.all([
        api("GET", "/v1/audit", undefined, { ndjson: true }),
        api("GET", "/v1/audit/verify").then((r) => r.body).catch((e) => {
          if (e instanceof ApiError && e.status === 403) return { forbidden: true };
          throw e;
        }),
      ]);
      drawList(entries.body.slice(-200).reverse());
      drawVerdict(v);
    },
  };
}

// ------------------------------------------------------------ policy

export function policy(ctx) {
  const admin = ctx.me.role === "admin";
  const text = h("textarea", { id: "policy-text", rows: 18, cols: 90, spellcheck: "false", readonly: !admin });
  const saved = h("p", { id: "policy-result", class: "muted" });
  const call = h("textarea", { id: "dry-call", rows: 4, cols: 90, spellcheck: "false",
    value: '{"kind": "exec", "argv": ["rm", "-rf", "/"]}' });
  const sbox = h("input", { id: "dry-sandbox", type: "text", placeholder: "sandbox id (optional)", size: 40 });
  const out = h("div", { id: "dry-result" });
  put(ctx.main, h("h1", {}, "Policy"),
    section("This tenant's policy (TOML)", text,
      admin ? h("div", { class: "actions" }, h("button", { type: "button", id: "policy-save", on: { click: save } }, "Save")) : h("p", { class: "muted" }, "Only admins change the policy."),
      saved),
    section("Dry run", h("p", { class: "muted" }, "Evaluate a tool call against the policy in force (nothing runs)."),
      call, h("div", { class: "actions" }, sbox, h("button", { type: "button", id: "dry-run", on: { click: dry } }, "Evaluate")), out));
  async function save() {
    try {
      await api("PUT", "/v1/policy", text.value, { type: "application/toml" });
      saved.textContent = `Saved ${new Date().toLocaleTimeString()}.`;
    } catch (e) {
      saved.textContent = e instanceof ApiError ? `${e.code}: ${e.message}` : String(e);
    }
  }
  async function dry() {
    let parsed;
    try { parsed = JSON.parse(call.value); } catch (e) { put(out, h("p", { class: "error" }, `Not JSON: ${e.message}`)); return; }
    const body = { call: parsed };
    if (sbox.value.trim()) body.sandbox = sbox.value.trim();
    try {
      const d = (await api("POST", "/v1/policy/test", body)).body;
      put(out, h("p", { class: `effect effect-${d.effect}` }, h("strong", {}, d.effect), ` by rule ${d.rule_id || "(default)"}${d.layer ? ` (${d.layer})` : ""}${d.hard ? ", hard" : ""}`),
        d.reason ? h("p", {}, d.reason) : "");
    } catch (e) {
      put(out, h("p", { class: "error" }, e instanceof ApiError ? `${e.code}: ${e.message}` : String(e)));
    }
  }
  let loaded = false;
  return {
    async refresh() {
      // Loaded once: an update must not overwrite what is being edited.
      if (loaded) return;
      const r = await api("GET", "/v1/policy");
      text.value = r.body.toml || "";
      loaded = true;
    },
  };
}

// ------------------------------------------------------------ stats

function latencyTable(map, id) {
  const rows = Object.entries(map || {}).sort((a, b) => b[1].count - a[1].count);
  if (rows.length === 0) return h("p", { class: "muted" }, "No samples yet.");
  const ms = (v) => (v == null ? "–" : Number(v).toFixed(1));
  return table(["Operation", "Count", "p50 ms", "p95 ms", "p99 ms", "max ms"], rows.map(([op, s]) =>
    h("tr", {}, h("td", {}, h("code", {}, op)), h("td", { class: "num" }, s.count), h("td", { class: "num" }, ms(s.p50_ms)),
      h("td", { class: "num" }, ms(s.p95_ms)), h("td", { class: "num" }, ms(s.p99_ms)), h("td", { class: "num" }, ms(s.max_ms)))), { id });
}

export function stats(ctx) {
  const body = h("div", { id: "stats" });
  put(ctx.main, h("h1", {}, "Latency"), body);
  const draw = drawer(body, (st) => [
    h("p", {}, "Sandboxes: ", Object.entries(st.sandboxes || {}).map(([k, v]) => h("span", { class: "chip" }, `${k} ${v}`)),
      ` · ready snapshots: ${st.snapshots ?? 0}`),
    section("API calls of this tenant", latencyTable(st.api, "api-latency")),
    section("VM steps", latencyTable(st.steps, "step-latency")),
  ]);
  return {
    async refresh() { draw((await api("GET", "/v1/stats")).body); },
  };
}
