"""Built-in strategies. Each module is its own entry point in the ``speculant.strategies`` group,
loaded exactly like a third-party plugin package would be."""
