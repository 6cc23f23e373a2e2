"""``python -m loaders.train`` and ``torchrun --nproc_per_node N -m loaders.train``: the ``train`` command."""

from loaders.train.cli import main

if __name__ == "__main__":
    main()
