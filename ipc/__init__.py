"""Messages between the daemon and its clients (msgpack over ZeroMQ)."""
