"""The task's init process ends as its command ended: any exit code, or the command's signal."""

import os
import subprocess
import sys

import pytest

INIT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "distrib_tf", "launch", "_task_init.py")


@pytest.mark.parametrize("command, code", [
    ("kill -KILL $$", -9),   # An OOM kill: before, `signal.signal(SIGKILL, ...)` raised OSError, exit 1.
    ("kill -TERM $$", -15),
    ("exit 140", 140),       # A real exit code above 128: before, read as a death by signal 12.
    ("exit 3", 3),
])
def test_the_init_ends_as_its_command_ended(command, code):
    ended = subprocess.run([sys.executable, INIT, str(os.getpid()), "bash", "-c", command],
                           capture_output=True, text=True, timeout=30)
    assert ended.returncode == code, ended.stderr
    assert "Traceback" not in ended.stderr
