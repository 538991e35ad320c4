// The sandbox page's terminal: a login shell on a PTY over a WebSocket
// (docs/console.md, "Terminal"). A ticket is asked for with the bearer
// (POST …/terminal); the socket then carries only that single-use ticket.
// Output is shown as text (textContent of a <pre>): escape sequences are
// dropped by a small parser, never interpreted, and nothing is parsed as
// markup.
import { api, ApiError } from "./api.js";
import { h, put } from "./dom.js";

const KEEP = 200000; // characters of output kept on screen

/** Drops ANSI escape sequences and control characters (state kept across chunks). */
export function stripper() {
  let st = 0; // 0 text, 1 after ESC, 2 CSI, 3 OSC/DCS string, 4 ESC inside a string
  return (text) => {
    let out = "";
    for (const ch of text) {
      const c = ch.codePointAt(0);
      if (st === 1) {
        st = ch === "[" ? 2 : (ch === "]" || ch === "P" || ch === "_" || ch === "^") ? 3 : 0;
      } else if (st === 2) {
        if (c >= 0x40 && c <= 0x7e) st = 0;
      } else if (st === 3) {
        if (c === 0x07) st = 0; else if (c === 0x1b) st = 4;
      } else if (st === 4) {
        st = ch === "\\" ? 0 : 3;
      } else if (c === 0x1b) {
        st = 1;
      } else if (c === 0x08) {
        out = out.slice(0, -1);
      } else if (ch === "\n" || ch === "\t" || (c >= 0x20 && c !== 0x7f && !(c >= 0x80 && c < 0xa0))) {
        out += ch;
      }
    }
    return out;
  };
}

export function terminal(sandboxId) {
  const screen = h("pre", { id: "terminal-output", class: "terminal", tabindex: "0" });
  const line = h("input", { id: "terminal-input", type: "text", autocomplete: "off", spellcheck: "false",
    placeholder: "type a command, Enter to send", disabled: true });
  const status = h("span", { id: "terminal-status", class: "muted" }, "closed");
  let ws = null;
  let strip = stripper();
  const decoder = new TextDecoder();
  const enc = new TextEncoder();

  function write(text) {
    if (!text) return;
    let t = screen.textContent + text;
    if (t.length > KEEP) t = t.slice(t.length - KEEP);
    screen.textContent = t;
    screen.scrollTop = screen.scrollHeight;
  }
  function send(bytes) {
    if (ws && ws.readyState === WebSocket.OPEN) ws.send(bytes);
  }
  function closed(why) {
    status.textContent = why;
    line.disabled = true;
    ws = null;
  }
  async function open() {
    if (ws) return;
    status.textContent = "connecting…";
    let r;
    try {
      r = await api("POST", `/v1/sandboxes/${encodeURIComponent(sandboxId)}/terminal`, { tty: { cols: 100, rows: 30 } });
    } catch (e) {
      status.textContent = e instanceof ApiError ? `refused: ${e.code}: ${e.message}` : String(e);
      return;
    }
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    status.textContent = "connecting… (a shell held by policy waits for an approver)";
    const sock = new WebSocket(`${scheme}//${location.host}${r.body.url}`);
    ws = sock;
    sock.binaryType = "arraybuffer";
    strip = stripper();
    sock.onopen = () => { status.textContent = "connected"; line.disabled = false; line.focus(); };
    sock.onmessage = (m) => {
      if (typeof m.data !== "string") {
        write(strip(decoder.decode(m.data, { stream: true })));
        return;
      }
      let v = null;
      try { v = JSON.parse(m.data); } catch { return; }
      if (v && v.exit !== undefined) write(`\n[exited with ${Number(v.exit)}]\n`);
      else if (v && v.error) write(`\n[error: ${String(v.error.code)}: ${String(v.error.message)}]\n`);
    };
    sock.onerror = () => { if (ws === sock) status.textContent = "connection failed (refused by policy, an expired ticket, or the network)"; };
    sock.onclose = () => { if (ws === sock) closed("closed"); };
  }
  function close() {
    if (ws) { const s = ws; closed("closed"); s.close(); }
  }
  line.addEventListener("keydown", (e) => {
    if (e.key === "Enter") {
      send(enc.encode(line.value + "\n"));
      line.value = "";
      e.preventDefault();
    } else if (e.ctrlKey && (e.key === "c" || e.key === "d") && !line.value) {
      send(enc.encode(e.key === "c" ? "\x03" : "\x04"));
      e.preventDefault();
    }
  });
  // Leaving the page hangs up (the shell gets SIGHUP).
  window.addEventListener("hashchange", close, { once: true });
  const box = h("div", { id: "terminal" },
    h("div", { class: "actions" },
      h("button", { type: "button", id: "terminal-open", on: { click: open } }, "Open shell"),
      h("button", { type: "button", id: "terminal-ctrl-c", on: { click: () => send(enc.encode("\x03")) } }, "Ctrl-C"),
      h("button", { type: "button", id: "terminal-ctrl-d", on: { click: () => send(enc.encode("\x04")) } }, "Ctrl-D"),
      h("button", { type: "button", id: "terminal-close", on: { click: close } }, "Close"),
      " ", status),
    screen, line);
  return box;
}

/** The panel for a sandbox page: the terminal, or why the role has none. */
export function terminalPanel(role, sandboxId) {
  const el = h("div", {});
  if (role === "admin" || role === "developer") put(el, terminal(sandboxId));
  else put(el, h("p", { class: "muted", id: "no-terminal" }, `Your role (${role}) cannot open a terminal.`));
  return el;
}
