"""Fixtures: one shared sandbox (the machine runs TCG guests slowly, so the
suite keeps the number of sandboxes small). The daemon is started by
../run-python.sh, which sets E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY."""

import os

import pytest
from e2b import Sandbox

SUITE = os.environ.get("STRATA_E2B_SUITE", "strata-e2b-tests")


@pytest.fixture(scope="session")
def sbx():
    s = Sandbox.create(metadata={"suite": SUITE, "role": "shared"}, timeout=600)
    yield s
    try:
        s.kill()
    except Exception:
        pass
