"""tests/workers/my_script.py with every background backup write slowed by 2 s, so that a
fault can strike while one is in flight. Prints `write of step N started` and
`write of step N done` (a backup's state) as the writer does them.

    python tests/workers/slow_writes.py [my_script.py's arguments]
"""

import os
import re
import runpy
import sys
import time

from distrib_tf.keras import backup

write = backup.write_state


def slow_write(path, values):
    step = re.search(r"step-(\d+)", os.path.basename(path))
    name = f"step {int(step.group(1))}" if step else os.path.basename(path)
    print(f"write of {name} started", flush=True)
    time.sleep(2)
    done = write(path, values)
    print(f"write of {name} done", flush=True)
    return done


backup.write_state = slow_write
sys.argv[0] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "my_script.py")
runpy.run_path(sys.argv[0], run_name="__main__")
