// The console's shell: sign-in, the hash router, the live-update loop.
import { api, setToken, signedIn, live, ApiError } from "./api.js";
import { h, put } from "./dom.js";
import * as pages from "./pages.js";

const main = document.getElementById("main");
const nav = document.getElementById("nav");
const whoEl = document.getElementById("who");
const liveEl = document.getElementById("live");
const signout = document.getElementById("signout");

/** Who signed in: {tenant, role, name, token_id}. */
let me = null;
let stopLive = null;
let current = null; // { refresh() } of the page shown
let busy = false;
let again = false;

function route() {
  const parts = (location.hash.replace(/^#\/?/, "") || "sandboxes").split("/").map(decodeURIComponent);
  return { page: parts[0], arg: parts[1] };
}

async function show() {
  if (!signedIn()) return signIn();
  const { page, arg } = route();
  for (const a of nav.querySelectorAll("a")) a.classList.toggle("on", a.dataset.page === page);
  const ctx = { me, main, go: (hash) => { location.hash = hash; }, error: showError };
  const view = {
    sandboxes: pages.sandboxes,
    sandbox: pages.sandbox,
    approvals: pages.approvals,
    audit: pages.audit,
    policy: pages.policy,
    stats: pages.stats,
  }[page] || pages.sandboxes;
  put(main);
  current = view(ctx, arg);
  await refresh();
}

/** Refreshes the page shown (one at a time; a request during one runs after it). */
async function refresh() {
  if (busy) { again = true; return; }
  busy = true;
  try {
    do {
      again = false;
      const page = current;
      if (page && page.refresh) {
        try { await page.refresh(); } catch (e) { showError(e); }
      }
      await pendingBadge();
    } while (again);
  } finally {
    busy = false;
  }
}

async function pendingBadge() {
  const b = document.getElementById("pending-count");
  try {
    const r = await api("GET", "/v1/approvals");
    const n = (r.body.items || []).length;
    b.hidden = n === 0;
    b.textContent = String(n);
  } catch { b.hidden = true; }
}

function showError(e) {
  let bar = document.getElementById("error");
  if (!bar) {
    bar = h("div", { id: "error", class: "error", role: "alert" });
    main.prepend(bar);
  }
  if (e instanceof ApiError && e.status === 401) {
    setToken(null);
    me = null;
    return signIn("The token was refused: sign in again.");
  }
  bar.textContent = e instanceof ApiError ? `${e.code}: ${e.message}` : String(e && e.message || e);
}

function signIn(message) {
  if (stopLive) { stopLive(); stopLive = null; }
  nav.hidden = true;
  signout.hidden = true;
  liveEl.hidden = true;
  whoEl.textContent = "";
  const input = h("input", { type: "password", id: "token", name: "token", autocomplete: "off", required: true, placeholder: "st_…", size: 48 });
  const err = h("p", { class: "error", id: "signin-error", hidden: !message }, message || "");
  const form = h("form", { id: "signin", class: "card narrow", on: { submit: async (ev) => {
    ev.preventDefault();
    setToken(input.value.trim());
    input.value = "";
    try {
      me = (await api("GET", "/v1/whoami")).body;
    } catch (e) {
      setToken(null);
      err.hidden = false;
      err.textContent = e instanceof ApiError ? `${e.code}: ${e.message}` : String(e);
      return;
    }
    started();
  } } },
    h("h1", {}, "Sign in"),
    h("p", { class: "muted" }, "Paste a strata API token. It is kept in this page's memory only: reloading the page signs you out."),
    h("label", { for: "token" }, "Token"), input,
    h("button", { type: "submit", id: "signin-submit" }, "Sign in"),
    err);
  put(main, form);
  input.focus();
}

function started() {
  nav.hidden = false;
  signout.hidden = false;
  whoEl.textContent = `${me.name || me.token_id} · ${me.tenant} · ${me.role}`;
  whoEl.dataset.role = me.role;
  liveEl.hidden = false;
  stopLive = live(() => refresh(), (mode) => {
    liveEl.textContent = mode === "live" ? "● live" : "○ polling";
    liveEl.dataset.mode = mode;
  });
  if (!location.hash || location.hash === "#/") location.hash = "#/sandboxes";
  else show();
}

signout.addEventListener("click", () => {
  setToken(null);
  me = null;
  signIn();
});
window.addEventListener("hashchange", () => { if (signedIn()) show(); });
signIn();
