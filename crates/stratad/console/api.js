// The /v1 API client. The bearer token lives in this module's variable only:
// never in localStorage, sessionStorage or a cookie, so no other origin (and
// no reload) can use it.

let token = null;

/** An error answer of the API: HTTP status, stable code, message. */
export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export function setToken(t) { token = t || null; }
export function signedIn() { return token !== null; }

function headers(extra) {
  const h = new Headers(extra || {});
  if (token) h.set("Authorization", `Bearer ${token}`);
  return h;
}

/** Calls the API; JSON in, JSON (or text for NDJSON) out; throws ApiError. */
export async function api(method, path, body, opts = {}) {
  const init = { method, headers: headers(), cache: "no-store", credentials: "omit" };
  if (body !== undefined) {
    if (typeof body === "string") {
      init.body = body;
      init.headers.set("Content-Type", opts.type || "text/plain");
    } else {
      init.body = JSON.stringify(body);
      init.headers.set("Content-Type", "application/json");
    }
  }
  const r = await fetch(path, init);
  const text = await r.text();
  let v = null;
  if (opts.ndjson && r.ok) {
    v = text.split("\n").filter((l) => l.trim()).map((l) => JSON.parse(l));
  } else {
    try { v = text ? JSON.parse(text) : null; } catch { v = text; }
  }
  if (!r.ok) {
    const e = (v && v.error) || {};
    throw new ApiError(r.status, e.code || "http_" + r.status, e.message || String(text).slice(0, 200));
  }
  return { status: r.status, body: v };
}

/**
 * Live updates: reads `GET /v1/events` (server-sent events) with fetch and a
 * stream parser (EventSource cannot send the Authorization header), resuming
 * with Last-Event-ID. While the route is absent or the stream is down, calls
 * `onEvent(null)` every 2 s instead (polling). Returns a stop function.
 */
export function live(onEvent, onMode) {
  let stopped = false;
  let lastId = null;
  let pollTimer = null;
  let ctrl = null;
  const poll = (on) => {
    if (on && !pollTimer) {
      pollTimer = setInterval(() => onEvent(null), 2000);
      onMode("polling");
    } else if (!on && pollTimer) {
      clearInterval(pollTimer);
      pollTimer = null;
    }
  };
  async function stream() {
    while (!stopped) {
      ctrl = new AbortController();
      try {
        const h = headers({ Accept: "text/event-stream" });
        if (lastId !== null) h.set("Last-Event-ID", lastId);
        const r = await fetch("/v1/events", { headers: h, signal: ctrl.signal, cache: "no-store", credentials: "omit" });
        const type = r.headers.get("content-type") || "";
        if (r.status !== 200 || !type.startsWith("text/event-stream") || !r.body) {
          r.body && r.body.cancel().catch(() => {});
          poll(true);
          // The route may come later (an upgrade); look again now and then.
          await sleep(30000);
          continue;
        }
        poll(false);
        onMode("live");
        onEvent(null); // catch up on what happened while not connected
        await parse(r.body, (ev) => {
          if (ev.id !== undefined) lastId = ev.id;
          let data = null;
          try { data = JSON.parse(ev.data); } catch { data = null; }
          onEvent({ kind: ev.event || "message", data });
        });
      } catch (e) {
        if (stopped) return;
      }
      if (stopped) return;
      poll(true);
      await sleep(2000);
    }
  }
  stream();
  return () => {
    stopped = true;
    poll(false);
    if (ctrl) ctrl.abort();
  };
}

function sleep(ms) { return new Promise((r) => setTimeout(r, ms)); }

/** Parses a text/event-stream body, calling `emit({id, event, data})` per message. */
async function parse(body, emit) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  let msg = { data: [] };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value;
    let nl;
    while ((nl = buf.search(/\r\n|\r|\n/)) >= 0) {
      const line = buf.slice(0, nl);
      buf = buf.slice(nl + (buf.startsWith("\r\n", nl) ? 2 : 1));
      if (line === "") {
        if (msg.data.length) emit({ id: msg.id, event: msg.event, data: msg.data.join("\n") });
        msg = { data: [] };
        continue;
      }
      if (line.startsWith(":")) continue;
      const i = line.indexOf(":");
      const field = i < 0 ? line : line.slice(0, i);
      let v = i < 0 ? "" : line.slice(i + 1);
      if (v.startsWith(" ")) v = v.slice(1);
      if (field === "data") msg.data.push(v);
      else if (field === "id") msg.id = v;
      else if (field === "event") msg.event = v;
    }
  }
}
