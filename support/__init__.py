"""Real services on 127.0.0.1 for the tests and the benchmarks: plain classes, no pytest.

- :mod:`support.loopback`: ``HOST``, the asyncio loop thread the servers run on, the request log;
- :mod:`support.http_server`: a folder served over HTTP (ranges, listings, ETags, injected faults);
- :mod:`support.s3_server`: moto's S3 server with every request logged, and the AWS environment that reaches it;
- :mod:`support.fault_proxy`: a fault-injecting proxy in front of either.

The pytest fixtures that start them for a test are in ``tests/servers.py`` and ``tests/fault_proxy.py``; the
benchmarks (``bench/``) start them by hand. Nothing here imports ``cachebuild``, ``loaders``, ``bench`` or
``tests`` (a contract in ``[tool.importlinter]`` holds it), and the package is not shipped.
"""
