"""A worker host: owns its local JAX devices, runs computations in the order the
controller dispatched them, keeps their outputs, and moves shards to peers."""
