"""Generated arithmetic word problems scored with math-verify."""

__version__ = "0.1.0"
