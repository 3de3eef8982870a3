"""systemd glue: sd_notify over `NOTIFY_SOCKET` (no libsystemd needed), the watchdog
cadence, and SIGTERM/SIGINT turned into a flag the serving loop reads."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import socket
import threading
import time


class Notifier:
    """Sends `READY=1`, `STOPPING=1`, `WATCHDOG=1`, ... to systemd; a no-op outside it."""

    def __init__(self) -> None:
        address = os.environ.get("NOTIFY_SOCKET", "")
        self._address: str | bytes | None = None
        if address:
            # A leading "@" names a socket in the abstract namespace.
            self._address = b"\0" + address[1:].encode() if address[0] == "@" else address
        self.watchdog_interval_s: float | None = None
        usec = os.environ.get("WATCHDOG_USEC", "")
        pid = os.environ.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_interval_s = int(usec) / 2e6  # ping at half the timeout
        self._last_ping = 0.0

    def notify(self, state: str) -> None:
        if self._address is None:
            return
        # Never block the engine loop: a full or vanished receiver just misses this notice.
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock, contextlib.suppress(OSError):
            sock.setblocking(False)
            sock.sendto(state.encode(), self._address)

    def ping_watchdog(self) -> None:
        """Call often; pings at most once per interval."""
        if self.watchdog_interval_s is None:
            return
        now = time.monotonic()
        if now - self._last_ping >= self.watchdog_interval_s:
            self._last_ping = now
            self.notify("WATCHDOG=1")


class StopFlag:
    """Set by SIGTERM or SIGINT; the loop drains and exits when it sees it."""

    def __init__(self) -> None:
        self.is_set = False
        self.at: float | None = None  # time.monotonic() of the first signal
        self.event = threading.Event()  # for threads that wait for it

    def set(self) -> None:
        if self.at is None:
            self.at = time.monotonic()
        self.is_set = True
        self.event.set()

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` dumps every thread's stack

    def _handle(self, signum: int, frame: object) -> None:
        self.set()


def raise_fd_limit() -> int:
    """Raise the soft limit on open files to the hard one (each client connection holds
    a descriptor; systemd's unit sets LimitNOFILE=) and return the limit now in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft


FD_RESERVE = 256  # descriptors kept for everything but client connections


def default_max_connections() -> int:
    """Client connections the open-file limit leaves room for, keeping FD_RESERVE for the
    model files, the KV events socket and its subscribers, ZeroMQ's and Python's own."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, soft - FD_RESERVE)
