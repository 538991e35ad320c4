// The unmodified @e2b/code-interpreter (npm 2.8.0) against the server:
// run by ../test_js.py with E2B_SANDBOX_URL pointing at a running server and
// STRATA_INTERP_JS_DEPS naming the npm prefix the SDK is installed in.
// The Sandbox comes from the SDK's own constructor (no E2B API call).
import { after, test } from 'node:test'
import assert from 'node:assert/strict'
import { createRequire } from 'node:module'
import path from 'node:path'

const require = createRequire(path.join(process.env.STRATA_INTERP_JS_DEPS, 'node_modules', 'x.js'))
const { Sandbox } = require('@e2b/code-interpreter')

const sandbox = new Sandbox({ sandboxId: 'strata-local', apiKey: 'e2b_unused' })

// runCode's request timer (requestTimeoutMs, 60 s) is left armed when the
// call fails before the body (the NotFoundError below) and would hold the
// process that long: exit once the tests are done, with their exit code.
after(() => setTimeout(() => process.exit(), 500).unref())

test('state survives between runCode calls', async () => {
  await sandbox.runCode('js_x = 1')
  const exec = await sandbox.runCode('js_x + 1')
  assert.equal(exec.text, '2')
  assert.equal(exec.error, undefined)
})

test('stdout streams to onStdout; an error has name, value and traceback', async () => {
  const lines = []
  const exec = await sandbox.runCode("print('from js sdk')\nraise KeyError('k')", {
    onStdout: (m) => lines.push(m.line),
  })
  assert.deepEqual(lines, ['from js sdk\n'])
  assert.deepEqual(exec.logs.stdout, ['from js sdk\n'])
  assert.equal(exec.error.name, 'KeyError')
  assert.equal(exec.error.value, "'k'")
  assert.match(exec.error.traceback, /KeyError/)
})

test('a matplotlib figure is a png result', async () => {
  const exec = await sandbox.runCode('import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()')
  const png = exec.results.find((r) => r.png)
  assert.ok(png, JSON.stringify(exec))
  assert.equal(Buffer.from(png.png, 'base64').subarray(1, 4).toString(), 'PNG')
})

test('contexts are isolated, listed, restarted and removed', async () => {
  const ctx = await sandbox.createCodeContext()
  try {
    await sandbox.runCode('only_here = 3', { context: ctx })
    assert.equal((await sandbox.runCode('only_here', { context: ctx })).text, '3')
    assert.equal((await sandbox.runCode("'only_here' in globals()")).text, 'False')
    const ids = (await sandbox.listCodeContexts()).map((c) => c.id)
    assert.ok(ids.includes(ctx.id))
    await sandbox.restartCodeContext(ctx)
    assert.equal((await sandbox.runCode('only_here', { context: ctx })).error.name, 'NameError')
  } finally {
    await sandbox.removeCodeContext(ctx)
  }
  await assert.rejects(sandbox.runCode('1', { context: ctx }), { name: 'NotFoundError' })
})

test('timeoutMs aborts and the kernel is interrupted', async () => {
  const ctx = await sandbox.createCodeContext()
  try {
    await assert.rejects(
      sandbox.runCode("import time\nmark = 'before'\ntime.sleep(60)\nmark = 'after'", { context: ctx, timeoutMs: 2000 }),
      { name: 'TimeoutError' },
    )
    const t0 = Date.now()
    const exec = await sandbox.runCode('mark', { context: ctx, timeoutMs: 15000 })
    assert.equal(exec.text, 'before')
    assert.ok(Date.now() - t0 < 10000)
  } finally {
    await sandbox.removeCodeContext(ctx)
  }
})

test('envs apply to one execution', async () => {
  const exec = await sandbox.runCode("import os; os.environ['JS_ENV']", { envs: { JS_ENV: 'yes' } })
  assert.equal(exec.text, 'yes')
  assert.equal((await sandbox.runCode("import os; os.environ.get('JS_ENV', 'unset')")).text, 'unset')
})
