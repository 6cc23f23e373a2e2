"""The ImageNet *shape* through the whole tool: each step's cost (time, memory) as a curve of N.

``python -m bench.scale`` (``make bench-scale``): ``tree`` (the generated ILSVRC2012-layout tree and its nested
subsets), ``steps`` + ``loader_steps`` (one step per child process), ``runner`` (runs and watches them),
``curves`` (the steps of one N), ``faults`` (kill-and-resume, val, Dask at the largest N), ``targets``,
``report`` (scale.md, scale.png), ``harness`` (the command).
"""
