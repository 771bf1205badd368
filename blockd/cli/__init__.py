"""The ``blockd`` console script: ``blockd serve`` runs the daemon; ``check-data``,
``repair-data`` and ``compact`` work on a data directory offline
(:mod:`blockd.offline.repair`, :mod:`blockd.offline.compact`); ``blockd reload
--pid-file FILE`` makes a serving daemon re-read its identities and waits for
its answer (:mod:`blockd.cli.reload`).

Every flag falls back to an environment variable named after it,
``BLOCKD_<FLAG>`` (``--fsync-interval-s`` -> ``BLOCKD_FSYNC_INTERVAL_S``; one
rule for all, :mod:`blockd.config_env`; ``blockd serve --help`` lists them);
a variable that does not parse is a one-line error, exit status 2. Main ones:

=======================  ============================  ====================================
flag                     env                           default
=======================  ============================  ====================================
``--listen``             ``BLOCKD_LISTEN``             ``127.0.0.1:50051`` (port 0: any)
``--advertise-address``  ``BLOCKD_ADVERTISE_ADDRESS``  the listen address
``--data-dir``           ``BLOCKD_DATA_DIR``           none: state in memory only
``--fsync``              ``BLOCKD_FSYNC``              ``always`` (``interval``, ``never``)
``--metrics-port``       ``BLOCKD_METRICS_PORT``       ``0``: no metrics endpoint
=======================  ============================  ====================================

A data dir is locked (:mod:`blockd.storage.lock`) for the daemon's life: a
second daemon on the same directory exits with status 1 and names the holder.

The idempotency table (:mod:`blockd.engine.idempotency`) is bounded by
``--max-request-ids`` (``BLOCKD_MAX_REQUEST_IDS``, 16384),
``--max-request-bytes`` (``BLOCKD_MAX_REQUEST_BYTES``, 64 MiB) and
``--request-ttl-s`` (``BLOCKD_REQUEST_TTL_S``, 3600): a retry is recognised
while its id is among the newest ids and younger than the TTL, and gets its
first answer while that answer also fits the byte cap.

With a metrics port, :mod:`blockd.service.metrics` (optional) times RPCs through a
server interceptor and WAL fsyncs through the engine, and serves ``/metrics``.

When the server is up it prints ``blockd listening on HOST:PORT`` (the real
port when 0 was asked for) on stdout, then ``blockd advertising HOST:PORT``
(the address others should dial: ``--advertise-address``, its port defaulting
to the bound one); tests and scripts wait for these lines.
SIGTERM and SIGINT shut down gracefully: stop accepting calls, give in-flight
ones a grace period, flush and close the log.

A damaged data directory (anything but a torn tail of the last log segment)
makes ``serve`` exit 1 with an ERROR line naming the file, byte offset and
record, having changed nothing; ``blockd check-data DIR`` reports the same
offline, and ``blockd repair-data DIR --truncate-at-first-bad`` is the
explicit way to cut the log there. While serving, the daemon holds
``DIR/blockd.lock``, so a second daemon (or a repair) on the same directory
is refused.
"""

from __future__ import annotations

import sys

from blockd import config_env, logs
from blockd.cli.flags import build_parser, data_dir_path, listen_address
from blockd.cli.serve import serve

__all__ = ["build_parser", "data_dir_path", "listen_address", "main", "serve"]


def main(argv: list[str] | None = None) -> int:
    args = config_env.parse_args(build_parser(), argv, "BLOCKD_")
    if args.command in ("tokens", "certs", "reload"):  # print their results on stdout; no log set-up
        return args.run(args)
    logs.configure(args.log_level, args.log_format, "%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return serve(args)
    if args.command == "compact":
        from blockd.offline.compact import main as compact_main

        return compact_main(args)
    from blockd.offline import repair

    if args.command == "check-data":
        return repair.check(args.data_dir, sys.stdout)
    if args.command == "repair-data":
        return repair.repair(args.data_dir, args.truncate_at_first_bad, sys.stdout)
    return 2

