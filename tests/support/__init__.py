"""What the tests share: fixtures (daemons, workers, etcd, network namespaces,
certificates), child-process helpers, reference models and the docs runner.

The test folders mirror the packages they test (``tests/blockd/engine`` tests
``blockd/engine``, ``tests/client`` tests ``client``, ...); tests of the whole
tree (layout, import cycles, the docs) sit in ``tests/`` itself.
"""
