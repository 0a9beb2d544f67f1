"""Run as an unprivileged user in the CT during the first deploy: try, as fast as it can, to reach the training
environment file (stat) and to read it. Writes what it saw as JSON when it gets SIGTERM.

    python3 secret_watch.py PATH RESULT_JSON
"""

import json
import os
import signal
import sys
import time

path, result = sys.argv[1], sys.argv[2]
seen = {"polls": 0, "reached": 0, "read": 0, "first_reached": None, "uid": os.getuid()}


def finish(*_):
    with open(result + ".tmp", "w") as f:
        json.dump(seen, f)
    os.rename(result + ".tmp", result)
    sys.exit(0)


signal.signal(signal.SIGTERM, finish)
deadline = time.monotonic() + 1800
while time.monotonic() < deadline:
    seen["polls"] += 1
    try:
        mode = os.stat(path).st_mode  # needs search permission on every folder above it
        seen["reached"] += 1
        seen["first_reached"] = seen["first_reached"] or oct(mode & 0o777)
        with open(path, "rb") as f:
            f.read(1)
        seen["read"] += 1
    except OSError:
        pass
    time.sleep(0.002)  # the folder check is exact; a faster poll would only cost the CT CPU
finish()
