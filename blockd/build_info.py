"""What this build is: the installed version, the Python running it, and the
standard metrics that say so on every ``/metrics`` of the project.

``version()`` is what ``blockd --version`` prints and the ``version`` label of
``blockd_build_info``; the daemon and the workers each keep their metrics in
their own ``CollectorRegistry`` (so tests can run several in one process),
and :func:`register_standard_metrics` gives such a registry what the
process-global one would have had: ``process_*`` (CPU, memory, open file
descriptors, start time), ``python_info`` and ``blockd_build_info`` (value 1,
the build in its labels, for joins and version dashboards: the version, the
Python, and ``core``, whether the allocator core runs compiled).

Standard library only at import time (``--version`` and ``--help`` stay
fast); prometheus_client is imported by :func:`register_standard_metrics`.
"""

from __future__ import annotations

import importlib.metadata
import platform
from typing import Any

#: the distribution whose version this is (pyproject.toml's ``name``)
DISTRIBUTION = "blockd"


def version() -> str:
    """The installed version, or ``unknown`` when running from a tree that was never installed."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def python_version() -> str:
    return platform.python_version()


def core_build() -> str:
    """``compiled`` or ``python``: the build of the allocator core this process
    runs (:data:`blockd.core.BUILD` without its reason, a bounded label)."""
    from blockd.core import BUILD  # standard library only, like this module

    return "compiled" if BUILD == "compiled" else "python"


def describe(program: str) -> str:
    """``--version``'s line: ``blockd 0.1.0 (Python 3.11.7, compiled core)``."""
    return f"{program} {version()} (Python {python_version()}, {core_build()} core)"


def register_standard_metrics(registry: Any) -> None:
    """Add ``process_*``, ``python_info`` and ``blockd_build_info`` to ``registry``
    (a ``CollectorRegistry`` of its own: the process-global one has the first two already)."""
    from prometheus_client import REGISTRY, Gauge, PlatformCollector, ProcessCollector

    if registry is not REGISTRY:
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
    info = Gauge("blockd_build_info", "The build serving these metrics (value 1): its version, Python and "
                 "whether its allocator core is compiled.", ("version", "python_version", "core"), registry=registry)
    info.labels(version(), python_version(), core_build()).set(1)


__all__ = ["DISTRIBUTION", "core_build", "describe", "python_version", "register_standard_metrics", "version"]
