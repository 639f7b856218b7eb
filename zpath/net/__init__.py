"""Wire layer: typed messages, the signed envelope and socket helpers.

This package knows nothing about programs; the controller, worker and client
build on it."""
