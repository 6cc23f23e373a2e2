"""The build: plan -> blocks -> decode -> storage sinks -> manifest -> rename into place.

``pipeline.build`` runs the steps: ``options`` (``BuildOptions``: what is asked, checked), ``staging`` (the
build key, the destination, the blocks an earlier run finished), ``block`` (one block's work in a worker:
``decode`` on the CPU or ``gpu_build`` on a GPU, into the storage kind's sink), ``finish`` (block records ->
side arrays and manifest -> commit). Beside them: ``destination`` (where a build may write and what it may
replace), ``locks`` (one writer per output), ``status`` (whether a built cache is stale against its source).
Nothing under ``cachebuild.storage``, ``cachebuild.format`` or ``loaders`` imports this package.
"""
