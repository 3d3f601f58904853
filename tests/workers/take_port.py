"""Takes this task's own port once, before TensorFlow binds it, then runs the command.

    take_port.py MARKER -- COMMAND ...

The first time (no MARKER file yet), task 0 of the first job listens on the port the
launcher picked for it and writes that address to MARKER: another process took the port
between the pick and the bind. Later starts run COMMAND untouched.
"""

import json
import os
import socket
import subprocess
import sys

marker, command = sys.argv[1], sys.argv[3:]
config = json.loads(os.environ["TF_CONFIG"])
held = None
if config["task"]["index"] == 0 and not os.path.exists(marker):
    address = config["cluster"][config["task"]["type"]][0]
    held = socket.socket()
    held.bind(("0.0.0.0", int(address.rpartition(":")[2])))
    held.listen()
    with open(marker, "w", encoding="utf-8") as f:
        f.write(address)
sys.exit(subprocess.call(command))
