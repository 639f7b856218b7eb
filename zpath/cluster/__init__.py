"""Cluster tooling: local and SSH launchers, the state file, the ``zpath`` CLI,
and the pytest plugin."""
