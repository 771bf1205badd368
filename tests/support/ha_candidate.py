"""A replica's election as a process of its own, for tests that SIGSTOP it.

    python -m tests.support.ha_candidate --etcd URL --group G --replica-id R [--ttl-s 4] [--margin-s 0.5]

Prints one JSON object per line (flushed), every time field ``at`` on
``time.monotonic()``, which is the system-wide CLOCK_MONOTONIC on Linux and
so comparable with the test's own clock:

* ``{"event": "started", "pid": ...}`` once;
* ``{"event": "elected", "term", "previous_term", "serving_since"}``;
* ``{"event": "stepped_down", "term", "reason", "valid_until", "at"}``: ``valid_until``
  is when its lease validity ended (or ends), as the election computed it;
* ``{"event": "ack", "value": bool, "at"}`` each time ``can_acknowledge()``
  changes, as seen by a thread that asks every 2 ms (what an engine would see);
  ``at`` is taken just before the call that answered.

Stops (resigning) on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

from blockd.ha.election import Election, ElectionConfig

_out = threading.Lock()


def emit(**fields) -> None:
    with _out:
        sys.stdout.write(json.dumps(fields) + "\n")
        sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--etcd", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--replica-id", required=True)
    parser.add_argument("--ttl-s", type=int, default=4)
    parser.add_argument("--margin-s", type=float, default=0.5)
    args = parser.parse_args()
    config = ElectionConfig(args.group, args.replica_id, f"{args.replica_id}.test:50051", ttl_s=args.ttl_s,
                            margin_s=args.margin_s, poll_s=0.1)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    election: Election | None = None

    def stepped_down(was, reason) -> None:
        emit(event="stepped_down", term=was.term, reason=reason, valid_until=election.last_valid_until,
             at=time.monotonic())

    election = Election(args.etcd, config, on_stepped_down=stepped_down,
                        on_elected=lambda won: emit(event="elected", term=won.term, previous_term=won.previous_term,
                                                    serving_since=won.serving_since))
    emit(event="started", pid=os.getpid())
    election.start()
    acking = False
    while not stop.is_set():
        asked_at = time.monotonic()  # before the call: a true answer was true at or after this
        now_acking = election.can_acknowledge()
        if now_acking != acking:
            acking = now_acking
            emit(event="ack", value=acking, at=asked_at)
        stop.wait(0.002)
    election.resign()


if __name__ == "__main__":
    main()
