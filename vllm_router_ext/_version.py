"""The package's version, in a module of its own so that any module can read it without importing
the package's ``__init__`` (no import circle)."""

__version__ = "0.1.0"
