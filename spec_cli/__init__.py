"""spec: fast, exact local text generation with staged speculative decoding."""

__version__ = "0.1.0"
