"""The unmodified @e2b/code-interpreter (npm 2.8.0) against the server:
tests/js/sdk.test.mjs under `node --test`. run.sh installs the SDK and finds
a Node >= 20.18.1 (STRATA_INTERP_NODE, STRATA_INTERP_JS_DEPS); without them
this test is skipped, and says so."""

import os
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def test_js_sdk_against_the_server(server):
    node = os.environ.get("STRATA_INTERP_NODE")
    deps = os.environ.get("STRATA_INTERP_JS_DEPS")
    if not node or not deps:
        pytest.skip("no Node >= 20.18.1 / @e2b/code-interpreter installed (run through tests/run.sh)")
    env = dict(os.environ, E2B_SANDBOX_URL=server.url, E2B_API_KEY="e2b_unused")
    proc = subprocess.run(
        [node, "--test", "--test-reporter=spec", str(HERE / "js" / "sdk.test.mjs")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
