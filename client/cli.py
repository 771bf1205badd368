"""``blockctl``: the operator's CLI over the SDK.

    blockctl [--target HOST:PORT] [--json] pools create NAME --num-blocks N --block-size B
    blockctl pools list
    blockctl pools show NAME
    blockctl seq show POOL SEQ
    blockctl events tail POOL [--from N] [--limit N] [--follow]
    blockctl top [--interval S] [--once]

Human-readable tables by default; ``--json`` prints JSON (events as one object
per line, so a tail can be piped). The target defaults to ``$BLOCKD_TARGET``
or ``127.0.0.1:50051``. Exit status: 0 ok, 1 the call failed (the status and
blockd's message go to stderr), 2 bad usage.

Each command group registers itself in :data:`COMMANDS` through one
``add_*(subparsers)`` function; ``blockctl top`` is :mod:`client.top`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence

from blockd.core.types import PoolConfig
from client.calls import DEFAULT_TARGET
from client.errors import BlockdClientError
from client.sdk import BlockdClient
from client.top import add_top

#: events `events tail` shows when no --from is given, like tail(1)
TAIL_DEFAULT = 10
_POOL_COLUMNS = ("name", "num_blocks", "block_size", "num_free_blocks", "num_used_blocks",
                 "num_evictable_blocks", "num_seqs", "num_tokens", "version")


def _jsonable(value):
    if dataclasses.is_dataclass(value):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def render_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Left-aligned text columns, two spaces apart; numbers right-aligned."""
    cells = [[str(cell) for cell in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [bool(cells) and all(r[i].lstrip("-").isdigit() for r in cells) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w)
                         for c, w, num in zip(cells, widths, numeric)).rstrip()

    return "\n".join([line([h.upper() for h in headers]), *(line(r) for r in cells)])


def _emit(args: argparse.Namespace, data: object, human: Callable[[], str]) -> None:
    print(json.dumps(_jsonable(data), indent=2) if args.json else human())


# --- pools ---------------------------------------------------------------------
def _pools_create(client: BlockdClient, args: argparse.Namespace) -> None:
    config = PoolConfig(name=args.name, num_blocks=args.num_blocks, block_size=args.block_size,
                        num_layers=args.num_layers, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                        dtype=args.dtype, watermark_blocks=args.watermark_blocks)
    stats = client.create_pool(config)
    _emit(args, stats, lambda: f"created pool {stats.name}: {stats.num_blocks} blocks of {stats.block_size}")


def _pools_list(client: BlockdClient, args: argparse.Namespace) -> None:
    pools = client.list_pools()
    _emit(args, pools, lambda: render_table(_POOL_COLUMNS, [[getattr(s, c) for c in _POOL_COLUMNS]
                                                            for s in pools]))


def _pools_show(client: BlockdClient, args: argparse.Namespace) -> None:
    config, stats = client.pool_config(args.name), client.get_pool(args.name)
    rows = [(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)]
    rows += [(f.name, getattr(stats, f.name)) for f in dataclasses.fields(stats) if f.name != "name"]
    rows += [("utilisation_ratio", f"{stats.utilisation_ratio:.3f}"),
             ("prefix_hit_ratio", f"{stats.prefix_hit_ratio:.3f}")]
    _emit(args, {"config": config, "stats": stats}, lambda: render_table(("field", "value"), rows))


def add_pools(sub: argparse._SubParsersAction) -> None:
    pools = sub.add_parser("pools", help="create, list and inspect pools").add_subparsers(dest="action",
                                                                                          required=True)
    create = pools.add_parser("create", help="create a pool")
    create.add_argument("name")
    create.add_argument("--num-blocks", type=int, required=True)
    create.add_argument("--block-size", type=int, required=True)
    create.add_argument("--num-layers", type=int, default=1)
    create.add_argument("--num-kv-heads", type=int, default=1)
    create.add_argument("--head-dim", type=int, default=1)
    create.add_argument("--dtype", default="float16")
    create.add_argument("--watermark-blocks", type=int, default=0)
    create.set_defaults(run=_pools_create)
    pools.add_parser("list", help="every pool's counters").set_defaults(run=_pools_list)
    show = pools.add_parser("show", help="one pool's config and counters")
    show.add_argument("name")
    show.set_defaults(run=_pools_show)


# --- sequences -----------------------------------------------------------------------
def _seq_show(client: BlockdClient, args: argparse.Namespace) -> None:
    info = client.get_sequence(args.pool, args.seq_id)

    def human() -> str:
        head = render_table(("field", "value"), [("seq_id", info.seq_id), ("num_tokens", info.num_tokens),
                                                 ("num_committed", info.num_committed),
                                                 ("num_blocks", len(info.block_table)),
                                                 ("kv_lost", info.kv_lost)])
        return f"{head}\nblock_table: {' '.join(map(str, info.block_table)) or '(empty)'}"

    _emit(args, info, human)


def add_seq(sub: argparse._SubParsersAction) -> None:
    seq = sub.add_parser("seq", help="inspect sequences").add_subparsers(dest="action", required=True)
    show = seq.add_parser("show", help="a sequence's token counts and block table")
    show.add_argument("pool")
    show.add_argument("seq_id")
    show.set_defaults(run=_seq_show)


# --- events -----------------------------------------------------------------------------
# fixed widths, since a followed stream cannot be measured before printing
_EVENT_LINE = "{:>8}  {:<16}  {:>8}  {:<16}  {:<16}  {:>6}"


def _event_row(event) -> list[object]:
    block = event.block_id if event.block_id >= 0 else "-"
    return [event.seq_no, event.kind, block, event.block_hash.hex()[:16] or "-",
            event.parent_hash.hex()[:16] or "-", len(event.token_ids)]


def _events_tail(client: BlockdClient, args: argparse.Namespace) -> None:
    last = client.get_pool(args.pool).last_event_seq_no
    start = args.from_seq_no if args.from_seq_no is not None else max(0, last - TAIL_DEFAULT)
    wanted = args.limit if args.limit is not None else (None if args.follow else max(0, last - start))
    if wanted == 0:
        return
    if not args.json:
        print(_EVENT_LINE.format("SEQ_NO", "KIND", "BLOCK", "HASH", "PARENT", "TOKENS"), flush=True)
    count = 0
    stream = client.events(args.pool, start)
    try:
        for event in stream:
            if args.json:
                print(json.dumps(_jsonable(event)), flush=True)
            else:
                print(_EVENT_LINE.format(*_event_row(event)), flush=True)
            count += 1
            if wanted is not None and count >= wanted:
                break
    finally:
        stream.close()


def add_events(sub: argparse._SubParsersAction) -> None:
    events = sub.add_parser("events", help="KV events of a pool").add_subparsers(dest="action", required=True)
    tail = events.add_parser("tail", help="print events in order (the last 10 unless --from)")
    tail.add_argument("pool")
    tail.add_argument("--from", dest="from_seq_no", type=int, default=None,
                      help="print events after this sequence number")
    tail.add_argument("--limit", type=int, default=None, help="stop after this many events")
    tail.add_argument("-f", "--follow", action="store_true", help="keep waiting for new events")
    tail.set_defaults(run=_events_tail)


#: command groups, each registering its subcommands (``top`` lives in client.top)
COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_pools, add_seq, add_events, add_top]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockctl", description="inspect and manage a blockd daemon")
    parser.add_argument("--target", default=os.environ.get("BLOCKD_TARGET", DEFAULT_TARGET),
                        help="blockd address HOST:PORT [env BLOCKD_TARGET]")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="deadline of each call")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with BlockdClient(args.target, timeout_s=args.timeout_s) as client:
            args.run(client, args)
    except BlockdClientError as err:
        print(f"blockctl: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. piped into head(1)
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
