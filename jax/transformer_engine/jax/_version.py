"""Version of transformer-engine-jax (matches its extension and the common wheel)."""

__version__ = "0.1.0"
