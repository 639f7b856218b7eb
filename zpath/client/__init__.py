"""The client library: everything that runs in the user's process (device sets
and placed functions, the traced program, futures, the connection)."""
