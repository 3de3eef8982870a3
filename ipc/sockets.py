"""Where the daemon listens, and the socket-file care an `ipc://` address needs.

Default address: `ipc://$RUNTIME_DIRECTORY/reprise.sock` under systemd, else
`ipc://$XDG_RUNTIME_DIR/reprise/reprise.sock`, else a per-user folder in /tmp.
Clients also try `/run/reprise/reprise.sock` (the systemd unit's place).
`REPRISE_SOCKET` overrides both sides. The daemon makes a missing socket folder: for a
chosen path only that folder (a typo above it is refused), for the default the runtime
folders above it too.

The daemon's socket is a plain stream socket (Unix or loopback TCP) carrying
length-prefixed msgpack frames (`framing`); only the KV events socket is ZeroMQ.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

SOCKET_ENV = "REPRISE_SOCKET"
SOCKET_NAME = "reprise.sock"
SYSTEM_SOCKET = Path("/run/reprise") / SOCKET_NAME


def user_socket_path() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "reprise" if runtime else Path(f"/tmp/reprise-{os.getuid()}")
    return base / SOCKET_NAME


def default_socket_path() -> Path:
    """Where `reprise serve` listens when neither --socket nor REPRISE_SOCKET chooses."""
    systemd_dir = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if systemd_dir:
        return Path(systemd_dir) / SOCKET_NAME
    return user_socket_path()


def server_address(explicit: str | None = None) -> str:
    """The address `reprise serve` binds."""
    if explicit:
        return explicit
    if os.environ.get(SOCKET_ENV):
        return os.environ[SOCKET_ENV]
    return f"ipc://{default_socket_path()}"


def client_address(explicit: str | None = None) -> str:
    """The address clients connect to: the flag, REPRISE_SOCKET, the user's socket if it
    exists, else the system one if it exists, else the user's (to name it in errors)."""
    if explicit:
        return explicit
    if os.environ.get(SOCKET_ENV):
        return os.environ[SOCKET_ENV]
    user = user_socket_path()
    if not user.exists() and SYSTEM_SOCKET.exists():
        return f"ipc://{SYSTEM_SOCKET}"
    if user.parent.exists():
        check_user_folder(user.parent)
    return f"ipc://{user}"


def check_user_folder(folder: Path) -> None:
    """Refuse (RuntimeError, one line) to talk through a per-user socket folder that
    another user owns or may write to: whoever could put a socket there would receive
    our prompts (the daemon refuses to serve from such a folder too)."""
    info = folder.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        owner = "you" if info.st_uid == os.getuid() else f"uid {info.st_uid}"
        raise RuntimeError(
            f"socket folder {folder} is owned by {owner} with mode {info.st_mode & 0o777:o}; "
            f"a client sends prompts only through a folder that is yours and that no one "
            f"else may write to (fix: remove it and restart the daemon, or choose --socket)"
        )


def ipc_path(address: str) -> Path | None:
    return Path(address[len("ipc://") :]) if address.startswith("ipc://") else None


def is_ipv6(address: str) -> bool:
    """Whether a tcp:// address names an IPv6 host (ZeroMQ needs its IPV6 option then)."""
    return address.startswith("tcp://[")


def socket_target(address: str) -> tuple[socket.AddressFamily, str | tuple[str, int]]:
    """The socket family and the bind/connect target of an ipc:// or tcp:// address."""
    path = ipc_path(address)
    if path is not None:
        return socket.AF_UNIX, str(path)
    if not address.startswith("tcp://") or ":" not in address[len("tcp://") :]:
        raise ValueError(f"socket address must be ipc://PATH or tcp://HOST:PORT; got {address!r}")
    host, port = address[len("tcp://") :].rsplit(":", 1)
    family = socket.AF_INET6 if host.startswith("[") else socket.AF_INET
    if not port.isdigit():
        raise ValueError(f"{address!r}: the port must be a number; got {port!r}")
    return family, (host.strip("[]"), int(port))


def check_address(address: str) -> None:
    """Only ipc:// paths and loopback tcp:// are served (the protocol has no
    authentication: a socket file's folder and mode are what keep others out)."""
    if address.startswith("ipc://@"):
        raise ValueError(
            f"abstract ipc sockets (ipc://@NAME) have no permissions, any local user could "
            f"connect; use ipc:///PATH; got {address}"
        )
    if address.startswith("ipc://"):
        if len(address) == len("ipc://"):
            raise ValueError(f"{address!r} names no socket file; expected ipc://PATH")
        return
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://") :].rpartition(":")
        if host not in ("127.0.0.1", "localhost", "[::1]"):
            raise ValueError(f"tcp addresses must be on loopback (127.0.0.1); got {address}")
        if not (port.isdigit() and 1 <= int(port) <= 65535):
            raise ValueError(f"{address!r} has no port in 1-65535; expected tcp://127.0.0.1:PORT")
        return
    raise ValueError(f"socket address must be ipc://PATH or tcp://127.0.0.1:PORT; got {address!r}")


def prepare_ipc_path(path: Path, flag: str = "--socket") -> None:
    """Make the socket's folder (make_socket_folder), refuse a folder that another user
    owns or that others may enter (anyone who can create files there could put their own
    socket in our place and read the prompts sent to it, as ssh-agent and tmux refuse),
    and refuse to take over a socket another live daemon is listening on (ZeroMQ would
    silently unlink it). Raises RuntimeError, one line naming `flag`."""
    folder = path.parent
    make_socket_folder(path, flag)
    info = folder.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o027:  # group may read (a named group)
        owner = "you" if info.st_uid == os.getuid() else f"uid {info.st_uid}"
        raise RuntimeError(
            f"socket folder {folder} is owned by {owner} with mode {info.st_mode & 0o777:o}; "
            f"it must be yours, with mode 700 or 750 (fix: chmod 700 {folder}, or remove it, or "
            f"choose another {flag})"
        )
    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()  # stale: nobody listens
        return
    finally:
        probe.close()
    raise RuntimeError(f"another daemon is already listening on ipc://{path}")


def make_socket_folder(path: Path, flag: str = "--socket") -> None:
    """Make the folder of the socket file `path` (mode 700) if it is missing. A chosen
    path gets only its own folder: a typo in a folder above it is refused (RuntimeError
    naming `flag` and the missing folder) rather than made into a tree. The default path
    gets the folders above it too: its runtime folder may not exist yet on a fresh
    machine."""
    folder = path.parent
    if folder.is_dir():
        return
    is_default = path == default_socket_path()
    if not is_default and not folder.parent.is_dir():
        raise RuntimeError(
            f"{flag} ipc://{path}: no folder {folder.parent}; reprise makes only the socket's "
            f"own folder ({folder}), not the folders above it (create {folder.parent}, or "
            f"choose another {flag})"
        )
    try:  # NOTE: parents are made with the umask's mode; the socket's folder is 700
        folder.mkdir(mode=0o700, parents=is_default, exist_ok=True)
    except OSError as e:
        raise RuntimeError(
            f"{flag} ipc://{path}: cannot make the socket folder {folder}: {e.strerror or e}"
        ) from None
