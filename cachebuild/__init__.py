"""cachebuild: decode an image dataset once into a fixed-shape uint8 cache that training jobs memory-map."""

__version__ = "0.1.0"

__all__ = ["__version__"]
