"""Loaded by every Python process whose PYTHONPATH starts with this folder: installs the fault named by
``CB_FAULT`` (see tests/reliability/faults.py). Without ``CB_FAULT`` it does nothing."""

import os

if os.environ.get("CB_FAULT"):
    from tests.reliability.faults import install

    install(os.environ["CB_FAULT"])
