"""A SIGTERM always reaches the daemon's loop: the loop's timed wait for arrivals
(Connections.wait) returns and the stop flag is seen, however close to the wait's
deadline the signal lands. On CPython 3.11 a SimpleQueue.get(timeout) interrupted by a
signal near its deadline could block forever without running the signal's handler (a
daemon in CI ignored every SIGTERM from then on); Connections now waits on a Queue.

Each try runs a fresh process that waits in Connections.wait with a 0.1 ms timeout in a
loop (so most signals land near a deadline) until its StopFlag is set, and SIGTERMs it
once it is waiting: it must exit promptly every time. With the SimpleQueue, about one try
in four hung."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import sys
from reprise.daemon.serve.connections import Connections, Limits
from reprise.daemon.serve.service import StopFlag

stop = StopFlag()
stop.install()
limits = Limits(max_connections=4, max_frame_bytes=1 << 16, max_skip_bytes=1 << 16,
                max_inbox_bytes=1 << 20, max_unread_bytes=1 << 20)
conns = Connections(sys.argv[1], limits)
conns.bind()
print("waiting", flush=True)
while not stop.is_set:
    conns.wait(0.0001)
conns.stop(linger_s=0.0)
print("stopped", flush=True)
"""


def test_a_sigterm_always_ends_the_loops_timed_wait(tmp_path: Path) -> None:
    for attempt in range(12):
        address = f"ipc://{tmp_path}/s{attempt}.sock"
        child = subprocess.Popen([sys.executable, "-c", CHILD, address], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "waiting", child.stderr.read()
            time.sleep(0.05 + 0.01 * attempt)  # land anywhere in the loop
            child.send_signal(signal.SIGTERM)
            out, err = child.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            raise AssertionError(f"try {attempt}: the SIGTERM left the loop waiting") from None
        assert child.returncode == 0 and out.strip() == "stopped", (attempt, out, err)
