"""Connecting to the daemon: a client whose daemon answered, and one line for each way
that fails ("no daemon": nothing listens; "busy": it accepted but did not answer in time;
a refusal), so a user is never shown a traceback for a daemon that is down."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import click

from ..ipc.client import Client, DaemonUnavailable, RequestError
from ..ipc.sockets import client_address, ipc_path

QUICK_S = 1.0  # a daemon that has not answered by then gets a "waiting" notice


def no_daemon(address: str, why: str) -> click.ClickException:
    return click.ClickException(
        f"no reprise daemon at {address} ({why}); start one with `reprise serve`, "
        "or point --socket / REPRISE_SOCKET at a running one"
    )


def busy(address: str, timeout: float) -> click.ClickException:
    return click.ClickException(
        f"the daemon at {address} is busy: it accepted the connection but sent no reply "
        f"within {timeout:g} s; try again, or wait longer with --timeout"
    )


def probe(address: str) -> str | None:
    """Why nothing listens at `address`, or None when something accepts a connection
    there (a daemon, maybe too busy to answer yet)."""
    path = ipc_path(address)
    target: str | tuple[str, int]
    if path is not None:
        if not path.exists():
            return f"no socket file at {path}"
        family, target = socket.AF_UNIX, str(path)
    else:  # tcp://HOST:PORT, checked by the --socket option
        host, port = address[len("tcp://") :].rsplit(":", 1)
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        target = (host, int(port))
    probe_sock = socket.socket(family, socket.SOCK_STREAM)
    probe_sock.settimeout(5.0)
    try:
        probe_sock.connect(target)
    except ConnectionRefusedError:
        if path is not None:
            return f"{path} exists but nothing listens on it"
        return "connection refused"
    except PermissionError:
        return f"permission denied on {path or address}"
    except FileNotFoundError:
        return f"no socket file at {path}"
    except OSError as e:
        return f"cannot connect: {e.strerror or e}"
    finally:
        probe_sock.close()
    return None


@contextmanager
def waiting_notice(text: str) -> Iterator[None]:
    """A spinner on stderr while we wait (nothing when stderr is not a terminal)."""
    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(text):
        yield


def connect(address: str | None, timeout: float) -> Client:
    """A client whose daemon has answered a health check. No daemon listening and a
    daemon that does not answer within `timeout` are different one-line errors."""
    try:
        address = client_address(address)
    except RuntimeError as e:  # the default socket's folder is not safely ours
        raise click.ClickException(str(e)) from None
    why = probe(address)
    if why is not None:
        raise no_daemon(address, why)
    client = Client(address, timeout_s=timeout)
    try:
        try:
            client.health(timeout_s=min(QUICK_S, timeout))
        except DaemonUnavailable:
            if timeout <= QUICK_S:
                raise
            with waiting_notice(f"the daemon at {address} is busy; waiting up to {timeout:g} s"):
                client.health(timeout_s=timeout - QUICK_S)
    except DaemonUnavailable as e:
        client.close()
        raise request_failed(client, e) from e
    except RequestError as e:
        client.close()
        raise click.ClickException(f"the daemon at {address} refused a health check: {e}") from e
    return client


def request_failed(client: Client, error: Exception) -> click.ClickException:
    """One line for a request that failed after we connected."""
    if isinstance(error, RequestError):
        return click.ClickException(f"the daemon refused the request: {error}")
    why = probe(client.address)
    return no_daemon(client.address, why) if why else busy(client.address, client.timeout_s)
