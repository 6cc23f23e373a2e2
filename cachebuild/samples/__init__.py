"""Sample datasets made from photographs shipped in wheels: the built-in sample (``cachebuild sample``, ``make
demo``: :mod:`~cachebuild.samples.imagenet_layout`, its photos and its broken files), deterministic from a seed."""
