// The unmodified `e2b` JS SDK (npm, the version package.json pins) against a
// real `stratad --e2b` with real QEMU guests, as a user's agent would drive
// it: create + a command, fork (the fork sees the parent's file, then the two
// diverge), a snapshot and a sandbox created from it, `getHost(port)` reached
// with Node's own `fetch`, and a PTY (input, resize, output, kill).
//
// Run by run-js.sh (it starts the daemon and sets E2B_API_URL,
// E2B_SANDBOX_URL, E2B_API_KEY and NODE_PATH): `node --test sdk.test.js`.

'use strict'

const { test, before, after } = require('node:test')
const assert = require('node:assert/strict')
const { Sandbox, CommandExitError } = require('e2b')

const SUITE = process.env.STRATA_E2B_SUITE || 'strata-e2b-js'
const SANDBOX_MS = 600_000 // sandbox timeout
const WAIT_MS = 60_000 // TCG guests are slow
const STEP = { timeout: 300_000 }

/** Every sandbox a test made, killed at the end even when a test failed. */
const made = []
let sbx

async function create(...args) {
  const s = await Sandbox.create(...args)
  made.push(s)
  return s
}

async function waitFor(what, cond, ms = WAIT_MS) {
  const deadline = Date.now() + ms
  while (Date.now() < deadline) {
    if (await cond()) return
    await new Promise((r) => setTimeout(r, 50))
  }
  assert.fail(`timed out waiting for ${what()}`)
}

before(async () => {
  sbx = await create({ metadata: { suite: SUITE, role: 'shared' }, timeoutMs: SANDBOX_MS })
})

after(async () => {
  for (const s of made) {
    try {
      await s.kill()
    } catch {}
  }
})

test('create and run commands as the user', STEP, async () => {
  assert.match(sbx.sandboxId, /\S/)
  const r = await sbx.commands.run('echo hi-$((6*7)); whoami; pwd')
  assert.equal(r.exitCode, 0)
  assert.equal(r.stdout, 'hi-42\nuser\n/home/user\n')
  // A failing command rejects with its exit code and output.
  await assert.rejects(sbx.commands.run('echo oops >&2; exit 3'), (e) => {
    assert.ok(e instanceof CommandExitError, String(e))
    assert.equal(e.exitCode, 3)
    assert.equal(e.stderr, 'oops\n')
    return true
  })
  assert.equal((await Sandbox.getInfo(sbx.sandboxId)).metadata.suite, SUITE)
})

test('fork: the forks see the parent files, then diverge', STEP, async () => {
  const path = '/home/user/fork.txt'
  await sbx.files.write(path, 'before fork')
  const forks = await sbx.fork({ count: 2, timeoutMs: SANDBOX_MS })
  for (const f of forks) if (f instanceof Sandbox) made.push(f)
  assert.equal(forks.length, 2)
  for (const f of forks) assert.ok(f instanceof Sandbox, `a fork failed: ${f}`)
  const ids = new Set([sbx.sandboxId, ...forks.map((f) => f.sandboxId)])
  assert.equal(ids.size, 3, 'each fork is a sandbox of its own')
  for (const f of forks) {
    assert.equal(await f.files.read(path), 'before fork')
    assert.equal((await f.commands.run('whoami')).stdout, 'user\n')
  }
  await forks[0].files.write(path, 'changed in fork 0')
  await sbx.files.write(path, 'changed in parent')
  assert.equal(await forks[0].files.read(path), 'changed in fork 0')
  assert.equal(await forks[1].files.read(path), 'before fork')
  assert.equal(await sbx.files.read(path), 'changed in parent')
  for (const f of forks) await f.kill()
})

test('snapshot: Sandbox.create(snapshotId) sees the state at the snapshot', STEP, async () => {
  const path = '/home/user/snap.txt'
  await sbx.files.write(path, 'in snapshot')
  const name = `js-snap-${Date.now()}`
  const snap = await sbx.createSnapshot({ name })
  assert.match(snap.snapshotId, /\S/)
  try {
    // The source goes on running, and what it writes later is not in the snapshot.
    await sbx.files.write(path, 'after snapshot')
    const listed = await Sandbox.listSnapshots({ sandboxId: sbx.sandboxId }).nextItems()
    assert.ok(
      listed.some((s) => s.snapshotId === snap.snapshotId),
      `snapshot ${snap.snapshotId} not listed: ${JSON.stringify(listed)}`,
    )
    const restored = await create(snap.snapshotId, { metadata: { suite: SUITE }, timeoutMs: SANDBOX_MS })
    assert.notEqual(restored.sandboxId, sbx.sandboxId)
    assert.equal(await restored.files.read(path), 'in snapshot')
    assert.equal(await sbx.files.read(path), 'after snapshot')
    await restored.kill()
  } finally {
    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true)
  }
  // Deleted: no longer listed, and a second delete finds nothing.
  const left = await Sandbox.listSnapshots({ sandboxId: sbx.sandboxId }).nextItems()
  assert.ok(!left.some((s) => s.snapshotId === snap.snapshotId), 'the deleted snapshot is still listed')
  assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), false)
})

test('getHost(port): a server in the guest reached with Node fetch', STEP, async () => {
  const port = 8000
  const body = 'served from the guest\n'
  await sbx.files.write('/tmp/www/hello.txt', body)
  await sbx.commands.run(`cd /tmp/www && python3 -m http.server ${port} --bind 127.0.0.1`, {
    background: true,
    timeoutMs: 0,
  })
  const up = await sbx.commands.run(
    'for i in $(seq 1 150); do python3 -c "import socket; ' +
      `socket.create_connection(('127.0.0.1', ${port})).close()" 2>/dev/null ` +
      '&& echo up && exit 0; sleep 0.2; done; echo down',
  )
  assert.equal(up.stdout.trim(), 'up')

  const api = new URL(process.env.E2B_API_URL)
  const host = sbx.getHost(port)
  assert.equal(host, `${port}-${sbx.sandboxId}.localhost:${api.port}`)
  const r = await fetch(`http://${host}/hello.txt`, { signal: AbortSignal.timeout(WAIT_MS) })
  assert.equal(r.status, 200)
  assert.equal(await r.text(), body)
  // The guest's own server answers: its 404 and its directory listing.
  const missing = await fetch(`http://${host}/nope.txt`, { signal: AbortSignal.timeout(WAIT_MS) })
  assert.equal(missing.status, 404)
  await missing.arrayBuffer()
  const listing = await fetch(`http://${host}/`, { signal: AbortSignal.timeout(WAIT_MS) })
  assert.equal(listing.status, 200)
  assert.match(await listing.text(), /hello\.txt/)
})

test('pty: create, input, resize, output, kill', STEP, async () => {
  const dec = new TextDecoder()
  const enc = new TextEncoder()
  let screen = ''
  const h = await sbx.pty.create({
    cols: 80,
    rows: 24,
    timeoutMs: 0,
    onData: (d) => {
      screen += dec.decode(d, { stream: true })
    },
  })
  assert.ok(h.pid > 0)
  let ended = false
  const done = h.wait().then(
    () => (ended = true),
    () => (ended = true),
  )
  const see = (needle) => waitFor(() => `${JSON.stringify(needle)} in ${JSON.stringify(screen)}`, () => screen.includes(needle))

  // The arithmetic makes the answer differ from the echo of the typed line.
  await sbx.pty.sendInput(h.pid, enc.encode('echo hi-$((40+2))\n'))
  await see('hi-42')
  await sbx.pty.sendInput(h.pid, enc.encode('tty; stty size\n'))
  await see('/dev/pts/')
  await see('24 80')
  await sbx.pty.resize(h.pid, { cols: 101, rows: 31 })
  await sbx.pty.sendInput(h.pid, enc.encode('stty size\n'))
  await see('31 101')

  assert.ok((await sbx.commands.list()).some((p) => p.pid === h.pid), 'the PTY is listed')
  assert.equal(await sbx.pty.kill(h.pid), true)
  await waitFor(() => 'the PTY stream to end after kill', () => ended)
  await done
  assert.equal(await sbx.pty.kill(h.pid), false)
  assert.ok(!(await sbx.commands.list()).some((p) => p.pid === h.pid), 'the PTY is gone')
})
