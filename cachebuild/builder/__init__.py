"""The build: plan -> blocks -> decode -> storage sinks -> manifest -> rename into place.

``pipeline`` runs it (``build`` one plan, ``build_source`` a source's splits: ``cachebuild.build``);
``options`` is what is asked (``BuildOptions``) and what identifies the result (the build key); ``block`` is one
block's work in a worker, ``sample`` one file's (probe, decode, window, resize) and ``gpu_build`` the same on a
GPU; ``destination`` says where a build may write and what it may replace, ``locks`` keeps one writer per output,
``update`` reuses an earlier cache's samples (``--update``), ``status`` says whether a cache is stale against
its source. Nothing under ``cachebuild.storage``, ``cachebuild.format`` or ``loaders`` imports this package.
"""
