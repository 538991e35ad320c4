// The browser leg of strata-bench's `events` section
// (crates/strata-bench/src/sections/events.rs, which embeds this file and
// runs it with node): signs in to the web console in headless Chromium
// (Debian's `chromium`, driven by playwright-core; no browser is
// downloaded), opens the approvals queue and reports, for every approval
// card that appears in it, when it appeared.
//
// Clock: the page reads `Date.now()` (the host's wall clock, ms), and so
// does the bench when it sends each request; both run on the same host, so
// the difference is the time from the request to the console showing it.
// The page records the time itself (a MutationObserver on the page; the
// report to node is asynchronous and its delay is not measured).
//
// Env: CONSOLE_URL (the daemon, e.g. http://127.0.0.1:1234), CONSOLE_TOKEN
// (an approver's or admin's token), CHROMIUM (/usr/bin/chromium),
// BENCH_MAX_S (300: the script ends by itself after this long), NODE_PATH
// (where playwright-core is installed).
//
// Out, one JSON object a line on stdout:
//   {"ready": true, "mode": "live" | "polling"}   signed in, queue shown
//   {"seen": "<approval id>", "dom_ms": t, "frame_ms": t}
//       dom_ms: the card was put into the page's DOM (the observer's
//       callback, before the next paint); frame_ms: the start of the next
//       animation frame after that (the frame that paints it)
//   {"gone": "<approval id>", "at_ms": t}        the card left the queue
//   {"error": "..."}                              then the script exits 1
// It ends when its stdin closes (the bench is done) or after BENCH_MAX_S.

'use strict'

const { chromium } = require('playwright-core')

const URL = process.env.CONSOLE_URL
const TOKEN = process.env.CONSOLE_TOKEN
const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium'
const MAX_S = Number(process.env.BENCH_MAX_S || 300)

function out(obj) {
  process.stdout.write(JSON.stringify(obj) + '\n')
}

async function main() {
  if (!URL || !TOKEN) throw new Error('CONSOLE_URL and CONSOLE_TOKEN must be set')
  const browser = await chromium.launch({
    executablePath: CHROMIUM,
    args: ['--no-sandbox', '--disable-gpu', '--disable-background-networking'],
  })
  let finished = false
  const finish = async (code) => {
    if (finished) return
    finished = true
    await browser.close().catch(() => {})
    process.exit(code)
  }
  // The bench closes our stdin when it is done (or dies).
  process.stdin.on('end', () => finish(0))
  process.stdin.on('error', () => finish(0))
  process.stdin.resume()
  setTimeout(() => {
    out({ error: `ran out of time (${MAX_S} s)` })
    finish(1)
  }, MAX_S * 1000).unref()

  const ctx = await browser.newContext({ viewport: { width: 1280, height: 860 } })
  const page = await ctx.newPage()
  page.on('pageerror', (e) => process.stderr.write(`console page error: ${e.message}\n`))
  page.on('dialog', (d) => d.dismiss().catch(() => {}))
  await page.exposeFunction('__benchReport', (msg) => out(msg))
  await page.goto(URL + '/console/')
  await page.fill('#token', TOKEN)
  await page.click('#signin-submit')
  await page.waitForSelector('#who:not(:empty)')
  await page.goto(URL + '/console/#/approvals')
  await page.waitForSelector('#pending')
  // The live mode (the event stream) is what is measured; polling (every
  // 2 s) is reported as such.
  await page.waitForSelector('#live[data-mode="live"]', { timeout: 10_000 }).catch(() => {})
  const mode = await page.getAttribute('#live', 'data-mode')
  await page.evaluate(() => {
    const shown = new Set()
    const ever = new Set()
    const scan = () => {
      const now = Date.now()
      const ids = new Set(
        [...document.querySelectorAll('#pending article[data-id]')].map((e) => e.dataset.id),
      )
      for (const id of ids) {
        shown.add(id)
        if (ever.has(id)) continue
        ever.add(id)
        requestAnimationFrame(() => {
          window.__benchReport({ seen: id, dom_ms: now, frame_ms: Date.now() })
        })
      }
      for (const id of [...shown]) {
        if (!ids.has(id)) {
          shown.delete(id)
          window.__benchReport({ gone: id, at_ms: now })
        }
      }
    }
    new MutationObserver(scan).observe(document.body, { childList: true, subtree: true })
    scan()
  })
  out({ ready: true, mode })
}

main().catch((e) => {
  out({ error: String((e && e.stack) || e) })
  process.exit(1)
})
