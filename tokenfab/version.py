"""tokenfab's version: a leaf, so any part names it without importing the package's public API."""
__version__ = "0.1.0"
