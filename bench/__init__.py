"""The benchmark harness: every contender side by side on the same real-photo files in one run.

``python -m bench --profile full|quick|tiny`` (``make bench``, ``make bench-quick``) writes
``bench/results/<date>-<host>/``: ``results.json`` (stable keys), ``results.md`` (the tables) and PNG
charts. Sections, each a module: ``build`` (source JPEGs -> cache), ``load`` (shuffled epochs of
batches), ``transforms`` (device transforms on a batch), ``train`` (a small model's epochs: where a
step's time goes), ``gpu`` (the same on CUDA, when there is one). Peers (FFCV, LitData, WebDataset) run
in their own virtual environments (``make bench-peers``) through ``bench.peers``.
"""
