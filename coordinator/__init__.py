"""fedbit coordinator: the full-precision server (round loop, strategies, brokers)."""

__version__ = "0.1.0"
