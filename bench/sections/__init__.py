"""The sections ``python -m bench`` runs in its own process or in child processes it watches: build, load,
transforms, train, gpu, the peers' remote load, and the script sections (``extras``: the scripts of
``bench/scripts/`` run as children). ``bench/README.md`` maps each to what it compares."""
