"""The daemon process: the ZeroMQ server loop over an engine, systemd glue, logs."""
