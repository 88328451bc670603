"""eagle3kit: train EAGLE3 speculative-decoding draft heads in pure JAX."""

__version__ = "0.1.0"
