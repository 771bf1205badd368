"""Run reports: a pool's statistics over a run drawn into one HTML file a person opens.

:mod:`client.report.series` records (no plotting library),
:mod:`client.report.advisor` recommends a block size (pure arithmetic),
:mod:`client.report.plots` draws with matplotlib (the ``report`` extra,
imported only when a report is drawn) and :mod:`client.report.render`
writes the page. The benchmarks (``bench/``) use it; it imports only the
core and :mod:`client.serving`, never the daemon.
"""
