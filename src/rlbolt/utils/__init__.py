"""Small helpers shared by the core and the application layer: atomic file writes and
plain-data conversion (files), CPU XLA flags and host-memory release (xla_flags), the names of
the `jax.distributed` environment variables (jax_env)."""
