"""The daemon's default guardrails: how big one request may be, whoever sends it.

Tenants' quotas (:mod:`blockd.engine.tenancy`) bound what one tenant may take, but
only where an identities file sets them. These bounds hold always, so that
one caller's request can neither hold the engine lock for long nor make the
daemon build a pool it cannot hold (a 30,000-op batch once held every other
caller for seconds):

* ``max_ops_per_step`` operations and ``max_tokens_per_step`` token ids in
  one step (``blockd serve --max-ops-per-step``, ``--max-tokens-per-step``);
* ``max_blocks_per_pool`` blocks in one pool (``--max-blocks-per-pool``);
* a new pool's name: at most ``max_name_length`` characters of letters,
  digits, ``.``, ``_`` and ``-``, starting with a letter or a digit
  (``--max-name-length``), because a pool name travels into metric labels,
  log lines, file names and shell commands.

A request past a bound is INVALID_ARGUMENT naming the bound, its flag and
what was asked, and changes nothing. The bounds apply to requests only,
never to records replayed from the log (a pool created under other bounds
still loads). Imports only the standard library and the core.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from blockd.core import Allocate, Append, DecodeAppend, InvalidArgument, Op, PoolConfig
from blockd.core.errors import shown
from blockd.core.pool import MAX_OPS_PER_STEP
from blockd.core.types import MAX_NUM_BLOCKS
from blockd.core.validate import MAX_ID_LEN

_NAME_CHARS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class Guardrails:
    max_ops_per_step: int = 8192
    max_tokens_per_step: int = 1 << 20
    max_blocks_per_pool: int = 1 << 22
    max_name_length: int = 128

    def __post_init__(self) -> None:
        for name, hi in (("max_ops_per_step", MAX_OPS_PER_STEP), ("max_tokens_per_step", 1 << 31),
                         ("max_blocks_per_pool", MAX_NUM_BLOCKS), ("max_name_length", MAX_ID_LEN)):
            value = getattr(self, name)
            if type(value) is not int or not 1 <= value <= hi:
                raise ValueError(f"{name} must be an integer in [1, {hi}], got {shown(value)}")

    def check_num_ops(self, num_ops: int) -> None:
        """Refuse a step of more operations than the bound (cheap: the servicer
        calls it before it converts a single operation)."""
        if num_ops > self.max_ops_per_step:
            raise InvalidArgument(
                f"a step holds at most {self.max_ops_per_step} operations (blockd serve --max-ops-per-step), "
                f"got {num_ops}; split the batch into several steps")

    def check_step(self, ops: Sequence[Op]) -> None:
        self.check_num_ops(len(ops))
        limit, total = self.max_tokens_per_step, 0
        for op in ops:
            if type(op) is DecodeAppend or type(op) is Append:
                tokens = op.token_ids
            elif type(op) is Allocate:
                tokens = op.prompt_token_ids
            else:
                continue
            if isinstance(tokens, (list, tuple)):
                total += len(tokens)
        if total > limit:
            raise InvalidArgument(
                f"a step carries at most {limit} token ids (blockd serve --max-tokens-per-step), got {total}; "
                "split the batch into several steps")

    def check_pool(self, config: PoolConfig) -> None:
        """A new pool's name and size."""
        name = config.name
        if type(name) is str and name:
            if len(name) > self.max_name_length:
                raise InvalidArgument(
                    f"pool name {shown(name[:40] + '...')} is {len(name)} characters long; pool names are at "
                    f"most {self.max_name_length} (blockd serve --max-name-length)")
            if not _NAME_CHARS.fullmatch(name):
                raise InvalidArgument(
                    f"pool name {shown(name)} may hold only letters, digits, '.', '_' and '-', and must start "
                    "with a letter or a digit")
        if type(config.num_blocks) is int and config.num_blocks > self.max_blocks_per_pool:
            raise InvalidArgument(
                f"a pool holds at most {self.max_blocks_per_pool} blocks (blockd serve --max-blocks-per-pool), "
                f"got num_blocks={config.num_blocks}")


__all__ = ["Guardrails"]
