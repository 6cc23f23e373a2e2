"""``cachebuild parity``: does a cache train like the torchvision pipeline it replaces?

Independent references (torchvision's ``ImageFolder`` and PIL transforms, the ImageNet devkit, CIFAR's python
batches, a Parquet label column) against what the cache serves: pixels, order and labels, the augmentation's
distributions, optionally a short training A/B. Nothing here imports the build or the sources: an oracle
sharing their code would agree with their bugs. Importing this package imports nothing.
"""
