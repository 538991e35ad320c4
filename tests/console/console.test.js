// End-to-end tests of the web console (/console/) in a real headless
// Chromium (Debian's `chromium`, driven by playwright-core; no browser is
// downloaded) against a real stratad with real QEMU guests, with the `strata`
// CLI as the agent's side: sign in; a sandbox created by the CLI appears
// without a reload (labels, size, age); a CLI exec held by an approve rule
// shows up in the queue, is approved in the browser (with a reason) and the
// CLI's command completes; rewind from the timeline and a file written after
// that snapshot is gone (and the sandbox page lists the rewind in its audit
// entries); the policy page saves an admin's edit; a viewer sees no approve
// button and its forged approve is refused; an approval whose argv is
// `<img src=x onerror=alert(1)>` is shown as text and runs no script; the CSP
// header is there and an inline script put into the page is blocked.
// Screenshots of the main pages go to CONSOLE_SHOTS (docs/console/), and the
// time from the CLI's held exec to the console showing it is printed
// (p50/p99 over CONSOLE_ROUNDS rounds).
//
// Run by scripts/run-console.sh (it starts the daemon and sets E2B_API_URL,
// STRATA_TOKEN (admin), STRATA_BIN and NODE_PATH): `node --test console.test.js`.

'use strict'

const { test, before, after } = require('node:test')
const assert = require('node:assert/strict')
const { spawn } = require('node:child_process')
const path = require('node:path')
const fs = require('node:fs')
const { chromium } = require('playwright-core')

const URL = process.env.E2B_API_URL
const ADMIN = process.env.STRATA_TOKEN
const CLI = process.env.STRATA_BIN
const SHOTS = process.env.CONSOLE_SHOTS || path.join(__dirname, '../../docs/console')
const ROUNDS = Number(process.env.CONSOLE_ROUNDS || 10)
const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium'
const STEP = { timeout: 600_000 }
const WAIT = 120_000 // TCG guests are slow
const XSS = '<img src=x onerror=alert(1)>'

let browser
let page // the admin's page
let dev, approver, viewer // tokens
let sb // the sandbox the CLI made
let forked // the sandbox forked from the console
const dialogs = [] // every JS dialog any page opened (there must be none)

async function api(method, p, token, body) {
  const r = await fetch(URL + p, {
    method,
    headers: { authorization: `Bearer ${token}`, 'content-type': 'application/json' },
    body: body === undefined ? undefined : typeof body === 'string' ? body : JSON.stringify(body),
  })
  const text = await r.text()
  let v
  try { v = JSON.parse(text) } catch { v = text }
  return { status: r.status, body: v }
}

/** Runs the CLI with the developer's token; resolves {code, stdout, stderr}. */
function cli(args, token = dev) {
  const child = spawn(CLI, args, {
    env: { ...process.env, STRATA_URL: URL, STRATA_TOKEN: token },
    stdio: ['ignore', 'pipe', 'pipe'],
  })
  let stdout = ''
  let stderr = ''
  child.stdout.on('data', (d) => { stdout += d })
  child.stderr.on('data', (d) => { stderr += d })
  const done = new Promise((resolve) => child.on('close', (code) => resolve({ code, stdout, stderr })))
  return { child, done }
}

async function cliOk(args) {
  const r = await cli(args).done
  assert.equal(r.code, 0, `strata ${args.join(' ')}: ${r.stderr}`)
  return r.stdout
}

async function newPage(token) {
  const ctx = await browser.newContext({ viewport: { width: 1280, height: 860 } })
  const p = await ctx.newPage()
  p.on('dialog', (d) => { dialogs.push(d.message()); d.dismiss().catch(() => {}) })
  p.on('pageerror', (e) => console.error('page error:', e.message))
  const resp = await p.goto(URL + '/console/')
  await p.fill('#token', token)
  await p.click('#signin-submit')
  await p.waitForSelector('#who:not(:empty)')
  return { p, resp }
}

async function shot(p, name, fullPage = true) {
  fs.mkdirSync(SHOTS, { recursive: true })
  await p.screenshot({ path: path.join(SHOTS, name), fullPage })
}

function pct(xs, q) {
  const s = [...xs].sort((a, b) => a - b)
  return s[Math.min(s.length - 1, Math.ceil(q * s.length) - 1)]
}

/** Waits until the pending approval of the call with argv `argv` is listed by the API; its id. */
async function heldId(argv) {
  const deadline = Date.now() + WAIT
  while (Date.now() < deadline) {
    const r = await api('GET', '/v1/approvals', ADMIN)
    const a = (r.body.items || []).find((x) => JSON.stringify(x.call.kind.argv) === JSON.stringify(argv))
    if (a) return a.id
    await new Promise((r) => setTimeout(r, 50))
  }
  assert.fail(`no approval for ${JSON.stringify(argv)}`)
}

before(async () => {
  assert.ok(URL && ADMIN && CLI, 'E2B_API_URL, STRATA_TOKEN and STRATA_BIN are set by run-console.sh')
  const tok = async (role) => {
    const r = await api('POST', '/v1/tokens', ADMIN, { role, name: `console-${role}` })
    assert.equal(r.status, 201, JSON.stringify(r.body))
    return r.body.token
  }
  dev = await tok('developer')
  approver = await tok('approver')
  viewer = await tok('viewer')
  // `echo` is held for a human (also inside `sh -c`: the tests write with printf); everything else is allowed.
  const policy = 'default = "allow"\n\n[[rule]]\nid = "echo-needs-human"\neffect = "approve"\nprogram = "echo"\nreason = "console test: a human answers"\n'
  const r = await api('PUT', '/v1/policy', ADMIN, policy)
  assert.equal(r.status, 200, JSON.stringify(r.body))
  browser = await chromium.launch({
    executablePath: CHROMIUM,
    args: ['--no-sandbox', '--disable-gpu', '--disable-background-networking'],
  })
})

after(async () => {
  if (browser) await browser.close()
  for (const id of [forked, sb]) if (id) await cli(['rm', id]).done
})

test('sign in, and every console response carries the strict headers', STEP, async () => {
  const { p, resp } = await newPage(ADMIN)
  page = p
  const h = resp.headers()
  assert.match(h['content-security-policy'], /default-src 'self'; script-src 'self'; style-src 'self'/)
  assert.match(h['content-security-policy'], /frame-ancestors 'none'/)
  assert.equal(h['x-content-type-options'], 'nosniff')
  assert.equal(h['referrer-policy'], 'no-referrer')
  assert.equal(h['x-frame-options'], 'DENY')
  assert.match(await page.textContent('#who'), /default · admin/)
  // The token is in memory only: no cookie, nothing stored.
  assert.deepEqual(await page.context().cookies(), [])
  assert.equal(await page.evaluate(() => localStorage.length + sessionStorage.length), 0)
  // A wrong token is refused on the sign-in form.
  const ctx = await browser.newContext()
  const q = await ctx.newPage()
  await q.goto(URL + '/console/')
  await q.fill('#token', 'st_not-a-token')
  await q.click('#signin-submit')
  await q.waitForSelector('#signin-error:not([hidden])')
  assert.match(await q.textContent('#signin-error'), /unauthorized/)
  await ctx.close()
})

test('a sandbox created by the CLI appears without a reload', STEP, async () => {
  await page.goto(URL + '/console/#/sandboxes')
  await page.waitForSelector('#sandboxes')
  const marker = await page.evaluate(() => (window.__noReload = Math.random()))
  const t0 = Date.now()
  const out = await cliOk(['create', '--json', '--label', 'made-by=console-test', '--snapshot-interval', '0'])
  sb = JSON.parse(out).id
  assert.ok(sb, out)
  await page.waitForSelector(`#sandboxes tr[data-id="${sb}"]`, { timeout: WAIT })
  console.error(`console: sandbox listed ${Date.now() - t0} ms after \`strata create\` started`)
  assert.equal(await page.evaluate(() => window.__noReload), marker, 'the page was reloaded')
  const row = await page.textContent(`#sandboxes tr[data-id="${sb}"]`)
  assert.match(row, /made-by=console-test/)
  // Size and age are shown too.
  assert.match(row, /\d+ vCPU · \d+ MiB · \d+ GiB/)
  assert.match(await page.textContent(`#sandboxes tr[data-id="${sb}"] td:last-child`), /^\d+[smhd] ago$/)
  await page.waitForSelector(`#sandboxes tr[data-id="${sb}"] .state-running`, { timeout: WAIT })
})

test('a held CLI exec shows up in the queue, is approved in the browser, and the command completes', STEP, async () => {
  await page.goto(URL + '/console/#/approvals')
  await page.waitForSelector('#pending')
  const ms = []
  for (let i = 0; i < ROUNDS; i++) {
    const word = `held-${i}`
    // Start at a random point of the page's 2 s polling period (when it
    // polls): the figure then samples the period, not one phase of it.
    await page.waitForTimeout(Math.floor(Math.random() * 2000))
    const t0 = Date.now()
    const run = cli(['exec', sb, '-n', '--', 'echo', word])
    const id = await heldId(['echo', word])
    const card = `#pending article[data-id="${id}"]`
    await page.waitForSelector(card, { timeout: WAIT })
    ms.push(Date.now() - t0)
    assert.match(await page.textContent(card), new RegExp(word))
    await page.fill(`${card} input.reason`, `round ${i} looks fine`)
    await page.click(`${card} button.approve`)
    const r = await run.done
    assert.equal(r.code, 0, r.stderr)
    assert.equal(r.stdout, `${word}\n`)
    const a = await api('GET', `/v1/approvals/${id}`, ADMIN)
    assert.equal(a.body.status.status, 'approved')
    assert.equal(a.body.status.reason, `round ${i} looks fine`)
  }
  const mode = await page.getAttribute('#live', 'data-mode')
  console.error(`console: held exec → shown in the approvals queue (${mode}): n=${ms.length} p50=${pct(ms, 0.5)} ms p99=${pct(ms, 0.99)} ms max=${Math.max(...ms)} ms`)
})

test('an approval whose argv is markup renders as text and runs no script', STEP, async () => {
  await page.goto(URL + '/console/#/approvals')
  await page.waitForSelector('#pending')
  await page.evaluate(() => { window.__xss = 0 })
  const before = dialogs.length
  const run = cli(['exec', sb, '-n', '--', 'echo', XSS, '<script>window.__xss=1</script>'])
  const id = await heldId(['echo', XSS, '<script>window.__xss=1</script>'])
  const card = `#pending article[data-id="${id}"]`
  await page.waitForSelector(card, { timeout: WAIT })
  await page.waitForTimeout(1500)
  const args = await page.$$eval(`${card} code.arg`, (els) => els.map((e) => e.textContent))
  assert.deepEqual(args, ['echo', XSS, '<script>window.__xss=1</script>'])
  assert.equal(await page.$$eval(`${card} img, ${card} script`, (els) => els.length), 0)
  assert.equal(await page.evaluate(() => document.querySelectorAll('main img, main script').length), 0)
  assert.equal(await page.evaluate(() => window.__xss), 0)
  assert.equal(dialogs.length, before, `dialogs opened: ${dialogs.slice(before)}`)
  await shot(page, 'approvals.png')
  await page.fill(`${card} input.reason`, 'markup in argv')
  await page.click(`${card} button.deny`)
  const r = await run.done
  assert.notEqual(r.code, 0, 'a denied call must fail')
  assert.match(r.stderr, /policy_denied|denied/)
  assert.equal(dialogs.length, before)
})

test('a viewer sees no approve button and its forged approve is refused', STEP, async () => {
  const run = cli(['exec', sb, '-n', '--', 'echo', 'viewer-check'])
  const id = await heldId(['echo', 'viewer-check'])
  const { p } = await newPage(viewer)
  // The link a webhook carries (docs/events.md) opens the queue with that
  // request highlighted.
  await p.goto(URL + `/console/#/approvals/${id}`)
  const card = `#pending article[data-id="${id}"]`
  await p.waitForSelector(card, { timeout: WAIT })
  assert.equal(await p.$$eval(`${card}.focus`, (els) => els.length), 1)
  assert.ok(await p.isVisible('#cannot-answer'))
  assert.equal(await p.$$eval(`${card} button`, (els) => els.length), 0)
  assert.equal(await p.$$eval('button.approve, button.deny', (els) => els.length), 0)
  // The viewer forges the request from the page with its own token.
  const forged = await p.evaluate(async ([id, token]) => {
    const r = await fetch(`/v1/approvals/${id}/approve`, {
      method: 'POST',
      headers: { Authorization: `Bearer ${token}`, 'Content-Type': 'application/json' },
      body: JSON.stringify({ reason: 'forged' }),
    })
    return { status: r.status, body: await r.json() }
  }, [id, viewer])
  assert.equal(forged.status, 403, JSON.stringify(forged.body))
  assert.equal(forged.body.error.code, 'forbidden')
  assert.equal((await api('GET', `/v1/approvals/${id}`, ADMIN)).body.status.status, 'pending')
  await p.context().close()
  // An approver answers it (over the API) and the CLI goes on.
  const a = await api('POST', `/v1/approvals/${id}/deny`, approver, { reason: 'viewer test done' })
  assert.equal(a.status, 200, JSON.stringify(a.body))
  assert.notEqual((await run.done).code, 0)
})

test('the terminal: a shell on a PTY over the WebSocket, its output shown as text', STEP, async () => {
  const { p } = await newPage(dev)
  await p.goto(URL + `/console/#/sandbox/${sb}`)
  await p.waitForSelector('#terminal-open')
  await p.click('#terminal-open')
  // The suite's policy holds `echo` for a human, and a bare shell can run
  // anything: the gate holds the terminal's exec (as the ticket's caller)
  // until an approver answers; the socket opens then.
  const held = await heldId(['/bin/sh', '-l'])
  assert.equal((await api('GET', `/v1/approvals/${held}`, ADMIN)).body.status.status, 'pending')
  const ok = await api('POST', `/v1/approvals/${held}/approve`, approver, { reason: 'terminal test' })
  assert.equal(ok.status, 200, JSON.stringify(ok.body))
  await p.waitForFunction(() => !/connecting/.test(document.querySelector('#terminal-status').textContent), null, { timeout: WAIT })
  assert.equal(await p.textContent('#terminal-status'), 'connected')
  const out = () => p.textContent('#terminal-output')
  await p.fill('#terminal-input', 'echo term-$((6*7))')
  await p.press('#terminal-input', 'Enter')
  await p.waitForFunction(() => /term-42/.test(document.querySelector('#terminal-output').textContent), null, { timeout: WAIT })
  // Markup printed by the guest is text: no element, no script.
  await p.fill('#terminal-input', `printf '%s\\n' '${XSS}'`)
  await p.press('#terminal-input', 'Enter')
  await p.waitForFunction((x) => document.querySelector('#terminal-output').textContent.split(x).length > 2, XSS, { timeout: WAIT })
  assert.equal(await p.$$eval('#terminal img, main img', (els) => els.length), 0)
  assert.ok(!/\x1b/.test(await out()), 'escape sequences are stripped')
  // ^C interrupts what runs; the shell lives on.
  await p.fill('#terminal-input', 'sleep 600')
  await p.press('#terminal-input', 'Enter')
  await p.click('#terminal-ctrl-c')
  await p.fill('#terminal-input', 'echo after-$((1+1))')
  await p.press('#terminal-input', 'Enter')
  await p.waitForFunction(() => /after-2/.test(document.querySelector('#terminal-output').textContent), null, { timeout: WAIT })
  await shot(p, 'sandbox-terminal.png')
  await p.fill('#terminal-input', 'exit 3')
  await p.press('#terminal-input', 'Enter')
  await p.waitForFunction(() => /\[exited with 3\]/.test(document.querySelector('#terminal-output').textContent), null, { timeout: WAIT })
  // A ticket is single-use and only opens from the daemon's own origin.
  const again = await p.evaluate(async ([sb, token]) => {
    const r = await fetch(`/v1/sandboxes/${sb}/terminal`, {
      method: 'POST',
      headers: { Authorization: `Bearer ${token}`, 'Content-Type': 'application/json' },
      body: JSON.stringify({ cmd: ['cat'] }),
    })
    const { url } = await r.json()
    const tryOpen = () => new Promise((resolve) => {
      const ws = new WebSocket(`ws://${location.host}${url}`)
      ws.onopen = () => { ws.close(); resolve('open') }
      ws.onerror = () => resolve('refused')
    })
    return [await tryOpen(), await tryOpen()]
  }, [sb, dev])
  assert.deepEqual(again, ['open', 'refused'])
  await p.context().close()
  // A viewer has no terminal and gets no ticket.
  const v = await newPage(viewer)
  await v.p.goto(URL + `/console/#/sandbox/${sb}`)
  await v.p.waitForSelector('#no-terminal')
  assert.equal(await v.p.$$eval('#terminal-open', (els) => els.length), 0)
  await v.p.context().close()
  const r = await api('POST', `/v1/sandboxes/${sb}/terminal`, viewer)
  assert.equal(r.status, 403, JSON.stringify(r.body))
  assert.deepEqual(dialogs, [])
})

test('rewind from the timeline: the file written after that snapshot is gone', STEP, async () => {
  const snap = JSON.parse(await cliOk(['snapshot', sb, '--label', 'before-file', '--json'])).id
  assert.ok(snap)
  await cliOk(['exec', sb, '-n', '--', 'sh', '-c', 'printf later > /root/after-snapshot.txt && sync'])
  assert.equal(await cliOk(['exec', sb, '-n', '--', 'cat', '/root/after-snapshot.txt']), 'later')
  await page.goto(URL + `/console/#/sandbox/${sb}`)
  const dot = `#timeline circle[data-id="${snap}"]`
  await page.waitForSelector(dot, { timeout: WAIT })
  await page.click(dot)
  await page.waitForSelector('#snapshot-detail #rewind')
  assert.match(await page.textContent('#snapshot-detail'), /before-file/)
  await page.click('#snapshot-detail #rewind')
  await page.waitForSelector('#confirm[open]')
  assert.match(await page.textContent('#confirm-text'), new RegExp(snap))
  await page.click('#confirm-ok')
  await page.waitForFunction(() => /Rewind: done|Rewind failed/.test(document.querySelector('#action-result').textContent), null, { timeout: WAIT })
  assert.equal(await page.textContent('#action-result'), 'Rewind: done.')
  const r = await cli(['exec', sb, '-n', '--', 'test', '-e', '/root/after-snapshot.txt']).done
  assert.equal(r.code, 1, `the file is still there: ${r.stdout}${r.stderr}`)
  // The timeline now holds the pre_rewind snapshot and the rewind's own
  // record (the restore point), and the events the rewind.
  await page.waitForSelector('#timeline circle.kind-pre_rewind', { timeout: WAIT })
  await page.waitForSelector('#timeline circle.kind-rewind', { timeout: WAIT })
  await page.waitForFunction(() => /rewind/.test(document.querySelector('#events').textContent), null, { timeout: WAIT })
  // The sandbox's audit entries: the rewind was decided and audited.
  await page.waitForFunction(() => /rewind/.test(document.querySelector('#sandbox-audit').textContent), null, { timeout: WAIT })
  assert.ok(await page.$$eval('#sandbox-audit tr[data-seq]', (els) => els.length) > 0)
  await page.click(dot)
  await shot(page, 'sandbox-timeline.png')
  // Fork from the same snapshot: a new sandbox, opened in the console,
  // without the file either.
  await page.click('#snapshot-detail #fork')
  await page.waitForSelector('#confirm[open]')
  await page.click('#confirm-ok')
  await page.waitForFunction((sb) => /^#\/sandbox\/sb-/.test(location.hash) && !location.hash.endsWith(sb), sb, { timeout: WAIT })
  forked = decodeURIComponent(await page.evaluate(() => location.hash.split('/')[2]))
  await page.waitForSelector('#sandbox-head .state-running', { timeout: WAIT })
  const f = await cli(['exec', forked, '-n', '--', 'test', '-e', '/root/after-snapshot.txt']).done
  assert.equal(f.code, 1, 'the fork has the file')
  await page.goto(URL + '/console/#/sandboxes')
  await page.waitForSelector(`#sandboxes tr[data-id="${forked}"]`, { timeout: WAIT })
  await shot(page, 'sandboxes.png')
})

test('the event stream: read with the token, resumed with Last-Event-ID', STEP, async () => {
  // The console's reader of GET /v1/events (docs/console.md) against a
  // stream served by the browser's router: the real route may or may not
  // be on this daemon, the client's side of the contract is tested here.
  const ctx = await browser.newContext()
  const seen = []
  await ctx.route('**/v1/events', async (route) => {
    const h = route.request().headers()
    seen.push({ auth: h.authorization, accept: h.accept, last: h['last-event-id'] })
    const body = seen.length === 1
      ? `: hello\n\nid: 7\nevent: sandbox\ndata: {"seq":7,"at":"2026-01-01T00:00:00Z","kind":"sandbox","sandbox_id":"${sb}"}\n\n`
      : ''
    await route.fulfill({ status: 200, headers: { 'content-type': 'text/event-stream' }, body })
  })
  let lists = 0
  ctx.on('request', (r) => { if (r.url().endsWith('/v1/sandboxes?limit=200')) lists++ })
  const p = await ctx.newPage()
  await p.goto(URL + '/console/')
  await p.fill('#token', viewer)
  await p.click('#signin-submit')
  await p.waitForSelector('#sandboxes')
  const deadline = Date.now() + 20_000
  while (seen.length < 2 && Date.now() < deadline) await p.waitForTimeout(100)
  assert.ok(seen.length >= 2, `the stream was not read again: ${JSON.stringify(seen)}`)
  assert.equal(seen[0].auth, `Bearer ${viewer}`)
  assert.equal(seen[0].accept, 'text/event-stream')
  assert.equal(seen[0].last, undefined)
  assert.equal(seen[1].last, '7', 'resumed from the last event id')
  assert.ok(lists >= 2, 'an event refreshes the page')
  await ctx.close()
})

test('the audit log shows the chain verdict, and the stats page the latencies', STEP, async () => {
  await page.goto(URL + '/console/#/audit')
  await page.waitForSelector('#verify-ok', { timeout: WAIT })
  await page.waitForSelector('#audit tr[data-seq]')
  assert.match(await page.textContent('#audit'), /markup in argv|approved|rejected/)
  await shot(page, 'audit.png', false)
  await page.goto(URL + '/console/#/stats')
  await page.waitForSelector('#api-latency')
  assert.match(await page.textContent('#api-latency'), /POST \/v1\/sandboxes\/:id\/exec/)
  await page.goto(URL + '/console/#/policy')
  await page.waitForFunction(() => /echo-needs-human/.test(document.querySelector('#policy-text').value))
  await page.fill('#dry-call', JSON.stringify({ kind: 'exec', argv: ['echo', 'hi'] }))
  await page.click('#dry-run')
  await page.waitForSelector('#dry-result .effect-approve')
  assert.match(await page.textContent('#dry-result'), /echo-needs-human/)
  // An admin edits and saves the policy in the console: the daemon has it.
  const before = (await api('GET', '/v1/policy', ADMIN)).body.toml
  await page.fill('#policy-text', before + '\n# saved from the console\n')
  await page.click('#policy-save')
  await page.waitForFunction(() => /^Saved|: /.test(document.querySelector('#policy-result').textContent))
  assert.match(await page.textContent('#policy-result'), /^Saved/)
  assert.match((await api('GET', '/v1/policy', ADMIN)).body.toml, /# saved from the console/)
})

test('the CSP blocks an inline script put into the page', STEP, async () => {
  await page.goto(URL + '/console/#/sandboxes')
  await page.waitForSelector('#sandboxes')
  const r = await page.evaluate(async () => {
    window.__inline = 0
    const seen = new Promise((resolve) => {
      document.addEventListener('securitypolicyviolation', (e) => resolve(e.violatedDirective), { once: true })
      setTimeout(() => resolve(null), 3000)
    })
    const s = document.createElement('script')
    s.textContent = 'window.__inline = 1'
    document.body.append(s)
    const d = document.createElement('div')
    d.setAttribute('onclick', 'window.__inline = 2')
    document.body.append(d)
    d.click()
    return { violated: await seen, inline: window.__inline }
  })
  assert.equal(r.inline, 0, 'an inline script ran')
  assert.match(String(r.violated), /script-src/)
})
