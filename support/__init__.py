"""What the tests and the benchmarks share, never shipped: real services on 127.0.0.1 and datasets in the layouts
of other tools. Plain classes and functions, no pytest.

- :mod:`support.loopback`: ``HOST``, the asyncio loop thread the servers run on, the request log;
- :mod:`support.http_server`: a folder served over HTTP (ranges, listings, ETags, injected faults);
- :mod:`support.s3_server`: moto's S3 server with every request logged, and the AWS environment that reaches it;
- :mod:`support.fault_proxy`: a fault-injecting proxy in front of either;
- :mod:`support.cifar_layout`, :mod:`support.wds_layout`, :mod:`support.parquet_layout`: CIFAR python batches,
  WebDataset shards and Hugging Face Parquet files as those tools write them (:mod:`support.archive`: a
  byte-stable ``.tar.gz``).

The pytest fixtures that start the services for a test are in ``tests/servers.py`` and ``tests/fault_proxy.py``;
the benchmarks (``bench/``) start them by hand. Nothing here imports ``cachebuild``, ``loaders``, ``bench`` or
``tests`` (a contract in ``[tool.importlinter]`` holds it): what the writers store (pictures, a tree's files) is
handed to them.
"""
