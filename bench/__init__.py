"""The benchmark harness: every contender side by side on the same real-photo files in one run.

``python -m bench --profile full|quick|tiny`` (``make bench``, ``make bench-quick``) writes
``bench/results/<date>-<host>/``: ``results.json`` (stable keys), ``results.md`` (the tables) and PNG
charts. Its sections are in ``bench/sections/`` (build, load, transforms, train, gpu, and the script
sections run from ``bench/scripts/``); peers (FFCV, LitData, WebDataset, ...) run in their own virtual
environments (``make bench-peers``) through ``bench.peers``; ``bench.scale`` is the ImageNet-shape run.
``bench/README.md`` maps each section to its module, what it compares and where its results go.
"""
