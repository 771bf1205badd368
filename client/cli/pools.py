"""``blockctl pools ...`` and ``blockctl prefix-cache ...``: pool lifecycle commands.

    blockctl pools create NAME --num-blocks N --block-size B [geometry flags]
    blockctl pools list
    blockctl pools show NAME
    blockctl pools misses NAME       # prompt tokens not served from cache, by reason
    blockctl pools delete NAME
    blockctl pools apply FILE        # idempotent: see client.cli.pool_apply
    blockctl pools pin POOL --tokens 1,2,3,... [--ttl-s S]   # hold a cached prefix in the device tier
    blockctl pools unpin POOL PIN_ID
    blockctl pools pins POOL         # what is pinned: blocks, tokens, deadline, tenant
    blockctl pools priority POOL --tokens 1,2,3,... --priority P   # keep a cached prefix at a retention priority
    blockctl prefix-cache reset POOL

Each ``add_*`` registers one command group with the parser (an entry of
``client.cli.COMMANDS``); the SDK owns the calls and their errors, and
:mod:`client.cli.common` the output and the exit status.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from blockd.config_env import non_negative_float, non_negative_int, positive_int
from blockd.core.lru import DEFAULT_PRIORITY, NUM_PRIORITIES
from blockd.core.pool import Pin
from blockd.core.types import PoolConfig
from client.cli import pool_apply
from client.cli.common import CommandFailed, Exit, emit, render_table
from client.groups import ClusterClient
from client.sdk import BlockdClient

_POOL_COLUMNS = ("name", "num_blocks", "block_size", "num_free_blocks", "num_used_blocks",
                 "num_evictable_blocks", "num_host_blocks", "num_host_cached_blocks", "num_seqs", "num_tokens",
                 "version", "tenant")


def _pools_create(client: BlockdClient, args: argparse.Namespace) -> None:
    config = PoolConfig(name=args.name, num_blocks=args.num_blocks, block_size=args.block_size,
                        num_layers=args.num_layers, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                        dtype=args.dtype, watermark_blocks=args.watermark_blocks, tenant=args.tenant,
                        num_host_blocks=args.host_blocks)
    stats = client.create_pool(config)
    host = f", {stats.num_host_blocks} in the host tier" if stats.num_host_blocks else ""
    emit(args, stats, lambda: f"created pool {stats.name}: {stats.num_blocks} blocks of {stats.block_size}{host}")


def _pools_list(client: BlockdClient, args: argparse.Namespace) -> None:
    pools = client.list_pools()
    emit(args, pools, lambda: render_table(_POOL_COLUMNS, [[getattr(s, c) for c in _POOL_COLUMNS]
                                                           for s in pools]))


def _pools_show(client: BlockdClient, args: argparse.Namespace) -> None:
    config, stats = client.pool_config(args.name), client.get_pool(args.name)
    rows = [(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)]
    rows += [(f.name, getattr(stats, f.name)) for f in dataclasses.fields(stats) if f.name != "name"]
    rows += [("utilisation_ratio", f"{stats.utilisation_ratio:.3f}"),
             ("prefix_hit_ratio", f"{stats.prefix_hit_ratio:.3f}")]
    emit(args, {"config": config, "stats": stats}, lambda: render_table(("field", "value"), rows))


def _pools_misses(client: BlockdClient, args: argparse.Namespace) -> None:
    stats = client.get_pool(args.name)
    missed = stats.prefix_miss_by_reason
    total = sum(missed.values())
    rows = [(reason, count, f"{count / total * 100:.1f}%" if total else "-") for reason, count in missed.items()]
    data = {"pool": stats.name, "queried_tokens": stats.prefix_queried_tokens,
            "hit_tokens": stats.prefix_hit_tokens, "missed_tokens": total, "miss_tokens": missed}
    emit(args, data, lambda: (f"pool {stats.name}: {stats.prefix_queried_tokens} prompt tokens queried, "
                              f"{stats.prefix_hit_tokens} hit, {total} missed\n"
                              + render_table(("reason", "tokens", "share"), rows)))


def _pools_move(client: BlockdClient | ClusterClient, args: argparse.Namespace) -> None:
    if not isinstance(client, ClusterClient):  # a plain daemon has no groups to move a pool between
        raise CommandFailed("pools move needs a cluster of daemon groups: --target cluster://ETCD_HOST:PORT/NAME",
                            Exit.USAGE)
    moved = client.move_pool(args.name, args.to_group)
    emit(args, {"pool": args.name, "group": moved.group, "epoch": moved.epoch, "version": moved.version},
         lambda: f"moved pool {args.name} to group {moved.group} at version {moved.version} (epoch {moved.epoch})")


def _pools_delete(client: BlockdClient, args: argparse.Namespace) -> None:
    client.delete_pool(args.name)
    emit(args, {"deleted": args.name}, lambda: f"deleted pool {args.name}")


def _token_ids(text: str) -> list[int]:
    """``1,2,3`` or ``1 2 3``: token ids (range checks are blockd's)."""
    try:
        ids = [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"token ids are integers separated by commas or spaces, got {text!r:.60}") from None
    if not ids:
        raise argparse.ArgumentTypeError("name at least one token id")
    return ids


def _deadline(pin: Pin) -> str:
    if not pin.expires_at:
        return "never"
    return f"in {max(0.0, pin.expires_at - time.time()):.1f} s"


def _pins_pin(client: BlockdClient, args: argparse.Namespace) -> None:
    pin = client.pin_prefix(args.pool, args.tokens, ttl_s=args.ttl_s)
    emit(args, pin, lambda: (f"pinned {pin.num_tokens} of {len(args.tokens)} tokens ({len(pin.block_ids)} blocks) "
                             f"of pool {pin.pool} as {pin.pin_id}; expires {_deadline(pin)}"))


def _pins_unpin(client: BlockdClient, args: argparse.Namespace) -> None:
    pin = client.unpin_prefix(args.pool, args.pin_id)
    emit(args, pin, lambda: f"unpinned {pin.pin_id} of pool {pin.pool}: {len(pin.block_ids)} blocks may be evicted")


def _prefix_priority(client: BlockdClient, args: argparse.Namespace) -> None:
    done = client.set_prefix_priority(args.pool, args.tokens, args.priority)
    emit(args, done, lambda: (f"kept {done.num_tokens} of {len(args.tokens)} tokens of pool {done.pool} at priority "
                              f"{done.priority} ({done.num_device_blocks} blocks in the device tier, "
                              f"{done.num_host_blocks} in the host tier)"))


def _priority(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < NUM_PRIORITIES:
        raise argparse.ArgumentTypeError(f"a priority is an integer in [0, {NUM_PRIORITIES - 1}] (lower is evicted "
                                         f"first; default {DEFAULT_PRIORITY}), got {text!r}")
    return value


def _pins_list(client: BlockdClient, args: argparse.Namespace) -> None:
    pins = client.list_pins(args.pool)
    rows = [[p.pin_id, len(p.block_ids), p.num_tokens, _deadline(p), p.tenant] for p in pins]
    emit(args, pins, lambda: render_table(("pin_id", "num_blocks", "num_tokens", "expires", "tenant"), rows))


def _describe(outcome: pool_apply.Outcome) -> str:
    if outcome.action != "differs":
        return f"{outcome.action} pool {outcome.name}"
    diffs = "; ".join(f"{field} is {have!r}, the file says {want!r}" for field, have, want in outcome.differences)
    return f"pool {outcome.name} differs from the file: {diffs} (left as it is)"


#: ``pools apply --help``: plain text, whole sentences (the module docstring is Sphinx markup)
APPLY_HELP = """\
The file is JSON: {"pools": [{"name": "default", "num_blocks": 4096,
"block_size": 16, ...}, ...]}, or the list alone; an entry takes the fields
of a pool config (name, num_blocks, block_size, num_layers, num_kv_heads,
head_dim, dtype, watermark_blocks, max_retained_versions, tenant,
num_host_blocks).

For each pool: a missing one is created; one whose stated fields all match
is left alone; one with another value for a stated field is reported and
left alone (exit 4): deleting a pool drops its sequences, so that is for
'blockctl pools delete'. Fields an entry does not state are not compared,
and pools the file does not list are not touched. The whole file is checked
before any call, so a bad file changes nothing; running it again gives the
same end state."""


def _pools_apply(client: BlockdClient, args: argparse.Namespace) -> None:
    try:
        wanted = pool_apply.load(args.file)
    except pool_apply.PoolFileError as err:
        raise CommandFailed(str(err), Exit.USAGE) from None
    outcomes = pool_apply.apply(client, wanted)
    emit(args, outcomes, lambda: "\n".join(_describe(o) for o in outcomes) or "no pools in the file")
    differing = [o.name for o in outcomes if o.action == "differs"]
    if differing:
        raise CommandFailed(f"pool(s) {', '.join(differing)} exist with another config; delete and apply "
                            "again to recreate them (this drops their sequences), or change the file",
                            Exit.CONFLICT)


def add_pools(sub: argparse._SubParsersAction) -> None:
    pools = sub.add_parser("pools", help="create, list, inspect, delete and apply pools").add_subparsers(
        dest="action", required=True)
    create = pools.add_parser("create", help="create a pool")
    create.add_argument("name")
    create.add_argument("--num-blocks", type=positive_int, required=True, help="blocks in the pool")
    create.add_argument("--block-size", type=positive_int, required=True, help="token slots per block")
    create.add_argument("--num-layers", type=positive_int, default=1, help="model layers (for bytes per block)")
    create.add_argument("--num-kv-heads", type=positive_int, default=1, help="KV heads per layer")
    create.add_argument("--head-dim", type=positive_int, default=1, help="dimension of one head")
    create.add_argument("--dtype", default="float16", help="KV element type")
    create.add_argument("--watermark-blocks", type=non_negative_int, default=0,
                        help="blocks kept back from new sequences so running ones can append")
    create.add_argument("--host-blocks", type=non_negative_int, default=0,
                        help="blocks of the host-memory tier per worker shard, with the device blocks' layout "
                             "(pinned host memory beside a GPU): evicted cached blocks move there and come "
                             "back on a prefix hit (default 0: no host tier)")
    create.add_argument("--tenant", default="",
                        help="the tenant that owns the pool (default: the caller's; only an admin names another)")
    create.set_defaults(run=_pools_create)
    pools.add_parser("list", help="every pool's counters").set_defaults(run=_pools_list)
    show = pools.add_parser("show", help="one pool's config and counters")
    show.add_argument("name")
    show.set_defaults(run=_pools_show)
    misses = pools.add_parser(
        "misses", help="a pool's prompt tokens not served from cache since it was made, by reason: never_stored, "
                       "evicted_device, evicted_host, partial (the block-size floor), other_extra_keys "
                       "(cached under another model, adapter or salt)")
    misses.add_argument("name")
    misses.set_defaults(run=_pools_misses)
    move = pools.add_parser("move", help="hand a pool to another daemon group of a cluster (--target cluster://"
                                         "...): its steps wait a moment, then continue at the new group")
    move.add_argument("name")
    move.add_argument("--to-group", required=True, help="the group that takes the pool")
    move.set_defaults(run=_pools_move)
    delete = pools.add_parser("delete", help="delete a pool with all its sequences and cached blocks")
    delete.add_argument("name")
    delete.set_defaults(run=_pools_delete)
    pin = pools.add_parser(
        "pin", help="hold a prefix's full blocks cached in the device tier (never evicted) until unpinned, its TTL "
                    "or a reset of the pool's prefix cache; they count as used blocks and against the tenant's "
                    "pinned_blocks quota")
    pin.add_argument("pool")
    pin.add_argument("--tokens", type=_token_ids, required=True, help="the prefix's token ids: 1,2,3 or '1 2 3'")
    pin.add_argument("--ttl-s", type=non_negative_float, default=0.0, help="let it go after S seconds (0: never)")
    pin.set_defaults(run=_pins_pin)
    unpin = pools.add_parser("unpin", help="let a pin go: its blocks may be evicted again")
    unpin.add_argument("pool")
    unpin.add_argument("pin_id")
    unpin.set_defaults(run=_pins_unpin)
    pins = pools.add_parser("pins", help="a pool's pins: blocks, tokens, when each expires, tenant")
    pins.add_argument("pool")
    pins.set_defaults(run=_pins_list)
    priority = pools.add_parser(
        "priority", help="keep a prefix's full blocks cached in either tier at a retention priority: lower is "
                         f"evicted first (0..{NUM_PRIORITIES - 1}, requests default to {DEFAULT_PRIORITY}); "
                         "evictable blocks move to the back of that priority, used ones enter it when let go "
                         "unless a holder's priority is higher")
    priority.add_argument("pool")
    priority.add_argument("--tokens", type=_token_ids, required=True, help="the prefix's token ids: 1,2,3 or '1 2 3'")
    priority.add_argument("--priority", type=_priority, required=True, metavar="P",
                          help=f"0..{NUM_PRIORITIES - 1}, lower evicted first")
    priority.set_defaults(run=_prefix_priority)
    apply = pools.add_parser(
        "apply", help="create the pools a JSON file lists that are missing; check the others match",
        description=APPLY_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    apply.add_argument("file", help='JSON: {"pools": [{"name": ..., "num_blocks": ..., "block_size": ...}]}; '
                                    "- reads standard input")
    apply.set_defaults(run=_pools_apply)


def _prefix_cache_reset(client: BlockdClient, args: argparse.Namespace) -> None:
    client.reset_prefix_cache(args.pool)
    emit(args, {"reset": args.pool}, lambda: f"reset the prefix cache of pool {args.pool}")


def add_prefix_cache(sub: argparse._SubParsersAction) -> None:
    group = sub.add_parser("prefix-cache", help="the prefix cache of a pool").add_subparsers(
        dest="action", required=True)
    reset = group.add_parser("reset", help="drop every cached prefix block of a pool (live sequences keep theirs)")
    reset.add_argument("pool")
    reset.set_defaults(run=_prefix_cache_reset)


__all__ = ["add_pools", "add_prefix_cache"]
