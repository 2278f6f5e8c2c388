"""quantkit's version (a leaf: written into every output file, shown by --version)."""
__version__ = "0.1.0"
