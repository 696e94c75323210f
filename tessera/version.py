"""The package version, in a module of its own so that importing it imports nothing else of ours."""

__version__ = "0.1.0"
