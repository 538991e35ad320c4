// The unmodified `@e2b/code-interpreter` JS SDK (npm, the version
// package.json pins) against a real `stratad --e2b`: `Sandbox.create()`
// asks for `code-interpreter-v1`, which the door resolves to the template
// named `code-interpreter`, built here once from
// templates/code-interpreter/recipe.toml through the daemon (the `strata`
// CLI; STRATA_INTERP_RECIPE names another copy). Then `runCode` state, an
// error's name/value/traceback, a matplotlib png, and the kernel state
// across pause/connect, fork and rewind.
//
// Run by run-js.sh (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY, STRATA_TOKEN,
// STRATA_BIN set): `node --test code_interpreter.test.js`.

'use strict'

const { test, before, after } = require('node:test')
const assert = require('node:assert/strict')
const path = require('node:path')
const { execFileSync } = require('node:child_process')
const { Sandbox } = require('@e2b/code-interpreter')

const ROOT = path.resolve(__dirname, '../../../..')
const RECIPE = process.env.STRATA_INTERP_RECIPE || path.join(ROOT, 'templates/code-interpreter/recipe.toml')
const CA = process.env.STRATA_CA_BUNDLE || '/etc/ssl/certs/ca-certificates.crt'
// Opt-in (STRATA_TEST_INTERP=1), as tests/python/test_code_interpreter.py:
// a cold build of the template takes about 25 minutes under TCG.
const OPT_IN = process.env.STRATA_TEST_INTERP === '1'
const STEP = { timeout: 600_000, skip: OPT_IN ? false : 'code-interpreter end-to-end tests are opt-in: STRATA_TEST_INTERP=1' }
let sbx

before(async () => {
  if (!OPT_IN) return
  const cli = process.env.STRATA_BIN || path.join(ROOT, 'target/release/strata')
  const t = Date.now()
  execFileSync(cli, ['--url', process.env.E2B_API_URL, 'template', 'build', '-f', RECIPE,
    '--name', 'code-interpreter', '--ca-bundle', CA, '--timeout', '2400'],
  { stdio: ['ignore', 'ignore', 'inherit'], timeout: 2_500_000 })
  console.log(`code-interpreter template build: ${((Date.now() - t) / 1000).toFixed(1)} s`)
  sbx = await Sandbox.create({ metadata: { suite: 'strata-e2b-js', role: 'interp' }, timeoutMs: 900_000 })
}, { timeout: 2_600_000 })

after(async () => {
  if (sbx) await sbx.kill().catch(() => {})
})

test('runCode keeps state between calls (the warm kernel of code-interpreter-v1)', STEP, async () => {
  const r = await fetch(`${process.env.E2B_API_URL}/v1/sandboxes/${sbx.sandboxId}`, {
    headers: { Authorization: `Bearer ${process.env.STRATA_TOKEN}` },
  })
  const info = await r.json()
  assert.notEqual(info.template, undefined)
  const first = await sbx.runCode('x = 1', { timeoutMs: 300_000 })
  assert.equal(first.error, undefined)
  const ex = await sbx.runCode('x + 1')
  assert.equal(ex.error, undefined)
  assert.equal(ex.text, '2')
})

test('an error has its name, value and traceback', STEP, async () => {
  const ex = await sbx.runCode("raise ValueError('bad value')")
  assert.ok(ex.error)
  assert.equal(ex.error.name, 'ValueError')
  assert.equal(ex.error.value, 'bad value')
  assert.match(ex.error.traceback, /ValueError/)
})

test('stdout comes to the callback', STEP, async () => {
  const out = []
  const ex = await sbx.runCode("print('hello js')", { onStdout: (m) => out.push(m.line) })
  assert.equal(ex.error, undefined)
  assert.equal(out.join(''), 'hello js\n')
})

test('a matplotlib figure is a png result', STEP, async () => {
  const ex = await sbx.runCode('import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()')
  assert.equal(ex.error, undefined)
  const pngs = ex.results.filter((r) => r.png)
  assert.equal(pngs.length, 1)
  const raw = Buffer.from(pngs[0].png, 'base64')
  assert.deepEqual([...raw.subarray(0, 8)], [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a])
})

test('kernel state survives pause and connect', STEP, async () => {
  assert.equal((await sbx.runCode("paused_state = 'kept'")).error, undefined)
  await sbx.pause()
  const s = await Sandbox.connect(sbx.sandboxId)
  const ex = await s.runCode('paused_state')
  assert.equal(ex.error, undefined)
  assert.equal(ex.text, 'kept')
})

test('kernel state is copied by fork, then independent', STEP, async () => {
  assert.equal((await sbx.runCode('forked = [1, 2]')).error, undefined)
  const forks = await sbx.fork({ count: 1, timeoutMs: 600_000 })
  assert.equal(forks.length, 1)
  const f = forks[0]
  assert.ok(f instanceof Sandbox, `the fork failed: ${f}`)
  try {
    const ex = await f.runCode('forked.append(3); forked')
    assert.equal(ex.error, undefined)
    assert.equal(ex.text, '[1, 2, 3]')
    assert.equal((await sbx.runCode('forked')).text, '[1, 2]')
  } finally {
    await f.kill()
  }
})

test('rewind brings back the kernel state of the snapshot', STEP, async () => {
  const api = async (method, p, body) => {
    const r = await fetch(`${process.env.E2B_API_URL}${p}`, {
      method,
      headers: { Authorization: `Bearer ${process.env.STRATA_TOKEN}`, 'Content-Type': 'application/json' },
      body: body === undefined ? undefined : JSON.stringify(body),
    })
    const text = await r.text()
    assert.ok(r.status < 300, `${method} ${p}: ${r.status} ${text}`)
    return JSON.parse(text)
  }
  assert.equal((await sbx.runCode("rewound = 'at snapshot'")).error, undefined)
  const snap = await api('POST', `/v1/sandboxes/${sbx.sandboxId}/snapshots`, { label: 'interp-rewind-js' })
  assert.equal((await sbx.runCode("rewound = 'after snapshot'; made_later = 1")).error, undefined)
  await api('POST', `/v1/sandboxes/${sbx.sandboxId}/rewind`, { to: snap.id })
  const ex = await sbx.runCode('rewound')
  assert.equal(ex.error, undefined)
  assert.equal(ex.text, 'at snapshot')
  const gone = await sbx.runCode('made_later')
  assert.ok(gone.error)
  assert.equal(gone.error.name, 'NameError')
})
