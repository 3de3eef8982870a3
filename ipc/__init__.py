"""Messages between the daemon and its clients (length-prefixed msgpack frames on a Unix or loopback TCP socket), and the client.

from reprise.ipc import Client
done = Client().generate("The capital of France is", max_tokens=8, temperature=0)
"""

from .client import Client, DaemonUnavailable, RequestError
from .messages import PROTOCOL_VERSION, Done, ProtocolError, TokenChunk

__all__ = [
    "PROTOCOL_VERSION",
    "Client",
    "DaemonUnavailable",
    "Done",
    "ProtocolError",
    "RequestError",
    "TokenChunk",
]
