"""Measurements that are whole scripts of their own, each run as ``python bench/scripts/X.py`` (its docstring
says what it compares); five of them are also sections of ``python -m bench`` (``bench.sections.extras``).
``ffcv_jpeg_contender.py`` runs in FFCV's own venv and imports nothing of the project."""
