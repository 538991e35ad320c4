// The unmodified `@e2b/code-interpreter` JS SDK (npm, the version
// package.json pins) against a real `stratad --e2b`: `Sandbox.create()`
// asks for `code-interpreter-v1`, which the door resolves to the template
// named `code-interpreter`, built here once from
// templates/code-interpreter/recipe.toml through the daemon (the `strata`
// CLI; STRATA_INTERP_RECIPE names another copy). Then `runCode` state, an
// error's name/value/traceback, and a matplotlib png.
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
