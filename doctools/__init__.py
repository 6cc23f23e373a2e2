"""The docs' tooling, apart from the measurements (``bench/``) it reads:

- :mod:`doctools.check_docs`: the checker ``make lint`` runs (every figure traced to a results file, generated
  blocks current, links, flags, make targets and keyword arguments real);
- :mod:`doctools.blocks`: the generated blocks (``<!-- bench:KIND:begin SOURCE -->``) found, checked and
  rewritten (``python -m doctools.blocks``), each kind written by
  :mod:`doctools.performance` (docs/performance.md's benchmark sections), :mod:`doctools.scale` (the scale
  block) or :mod:`doctools.summary` (the README's headline and commands blocks, the reliability table);
- :mod:`doctools.timings`: the README's stated durations, measured into a results folder (``make timings``).

It imports ``bench`` (the results' formatting, the machine record), never ``tests``; nothing in ``bench``
imports it. Not shipped.
"""
