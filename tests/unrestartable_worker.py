"""Test program: a worker whose machine is gone for good, for tests/test_recovery.py.

    python -m expframe.launch ... -- tests/unrestartable_worker.py main.py --gin_file=...

Runs the rest of its command line with this Python (`os.execv`: same pid), except in
the launcher slot `$EXPFRAME_TEST_DEAD_SLOT` once the file `$EXPFRAME_TEST_DEAD_MARKER`
exists: there it exits 1 at once, on every start. Only tests set these variables.
"""

import os
import sys

slot = os.environ.get("EXPFRAME_LAUNCH_SLOT")
marker = os.environ.get("EXPFRAME_TEST_DEAD_MARKER")
if slot is not None and slot == os.environ.get("EXPFRAME_TEST_DEAD_SLOT") and marker and os.path.exists(marker):
    print(f"unrestartable_worker: launcher slot {slot} is gone for good", flush=True)
    sys.exit(1)
os.execv(sys.executable, [sys.executable] + sys.argv[1:])
