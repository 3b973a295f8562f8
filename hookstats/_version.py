"""The package version (a leaf: hookstats modules import it without importing the package)."""
__version__ = "0.1.0"
