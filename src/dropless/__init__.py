"""dropless: Mixture-of-Experts training on PyTorch without dropping tokens."""

__version__ = "0.1.0"
