"""radbo's version (a module of its own, so that any part of radbo can read it)."""

__version__ = "0.1.0"
