"""raytrain-sys: elastic training on Ray and PyTorch."""

__version__ = "0.1.0"
