"""The package's version, where any layer can read it (the package root re-exports it)."""

__version__ = "0.1.0"
