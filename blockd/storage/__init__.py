"""A data directory on disk: the write-ahead log and snapshots, verified reading, the lock, cutting the log.

* :mod:`blockd.storage.wal` - the on-disk format and its writers;
* :mod:`blockd.storage.fsyncer` - a background fdatasync that says so on a pipe (C where compiled);
* :mod:`blockd.storage.reader` - reading a directory back, every byte verified first;
* :mod:`blockd.storage.lock` - one daemon per data directory;
* :mod:`blockd.storage.cut` - cutting the log, the three ways blockd does it.

Knows bytes, records' framing and LSNs, not what a record means: it imports
nothing of the engine above it.
"""
