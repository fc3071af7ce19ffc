"""Built-in callbacks, installed as ``rlbolt.callbacks``."""
