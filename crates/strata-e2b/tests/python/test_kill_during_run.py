"""A sandbox killed while a command runs: the SDK's wait() ends with a
TimeoutException that says the sandbox was killed (the door tells a killed
sandbox from a paused one when a process stream ends without its exit)."""

import pytest
from e2b import Sandbox
from e2b.exceptions import TimeoutException

from conftest import SUITE


def test_killing_the_sandbox_ends_a_running_command_saying_so():
    s = Sandbox.create(metadata={"suite": SUITE, "role": "kill-during-run"}, timeout=120)
    cmd = s.commands.run("sleep 60", background=True)
    s.kill()
    with pytest.raises(TimeoutException) as e:
        cmd.wait()
    assert "sandbox was killed or reached its end of life" in str(e.value)
    assert "(the sandbox was paused)" not in str(e.value)
