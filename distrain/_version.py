"""The package's version, in a module of its own: what reads it (the kept plan's key, ``distrain --version``) need not
import the package's front, which names every class."""

__version__ = "0.1.0"
