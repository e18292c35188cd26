"""The package's version, in a leaf module: fingerprints record it without importing the package."""

__version__ = "0.1.0"
