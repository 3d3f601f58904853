"""A child that asked for it gets SIGTERM when its parent dies (a Ray worker's main job)."""

import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(__file__))
CHILD = """
import signal, sys, time
from distrib_tf import lifeline
signal.signal(signal.SIGTERM, lambda *_: (open(sys.argv[1], "w").write("SIGTERM"), sys.exit(75)))
lifeline.die_with_parent()
print("ready", flush=True)
time.sleep(60)
"""
PARENT = """
import os, subprocess, sys
env = {**os.environ, "DISTRIB_TF_PARENT_PID": str(os.getpid())}
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], env=env)
print(child.pid, flush=True)
child.wait()
"""


def test_the_child_gets_sigterm_when_its_parent_is_killed(tmp_path):
    seen = tmp_path / "seen"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(seen)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": ROOT})
    child = int(parent.stdout.readline())
    time.sleep(1.5)  # The child is up and has asked.
    parent.send_signal(signal.SIGKILL)  # As a Ray worker dies.
    parent.wait()
    parent.stdout.close()
    deadline = time.monotonic() + 20
    while not (seen.exists() and seen.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert seen.read_text() == "SIGTERM"
    deadline = time.monotonic() + 20
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:  # It left (exit 75), reaped by init.
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{child}")
