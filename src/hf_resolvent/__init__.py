"""hf-resolvent: resolvent token mixers Y = (I - B)^-1 A X for Hugging Face transformers."""

from .patterns import Pattern, get_pattern

__version__ = "0.1.0"

__all__ = ["Pattern", "get_pattern", "__version__"]
