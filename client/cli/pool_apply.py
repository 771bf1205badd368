"""``blockctl pools apply FILE``: make the pools a file lists exist, idempotently.

The file is JSON: ``{"pools": [{"name": "default", "num_blocks": 4096,
"block_size": 16, ...}, ...]}`` (or the list alone); each entry takes the
fields of :class:`blockd.core.types.PoolConfig`. For each pool:

* missing: created;
* present, and every field the entry states has that value: left alone;
* present with another value for a stated field: reported (field, what the
  pool has, what the file wants) and left alone. A pool's geometry cannot
  change under live sequences, and deleting it would drop them: that is an
  operator's decision (``blockctl pools delete``), never this command's.

Fields an entry does not state are not compared (the file pins what it
says; a field blockd adds later does not make every old file differ).
Pools the file does not list are not touched. The whole file is checked
(unknown fields, duplicate names, sizes blockd would refuse) before any
call, so a bad file changes nothing. Running it again, or two at once (a
create that meets ALREADY_EXISTS re-reads the pool and compares), gives
the same end state: what a Kubernetes Job or a compose service needs.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass

from blockd.core.errors import BlockdError
from blockd.core.types import PoolConfig
from blockd.core.validate import check_config
from client.errors import AlreadyExistsError, NotFoundError

_FIELDS = {f.name: f.type for f in dataclasses.fields(PoolConfig)}
_REQUIRED = [f.name for f in dataclasses.fields(PoolConfig)
             if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
#: field annotations (strings under postponed evaluation) checked before PoolConfig sees them
_TYPES = {"str": str, "int": int}


class PoolFileError(ValueError):
    """The file cannot be read as pools; nothing was changed."""


@dataclass(frozen=True)
class Wanted:
    """One entry of the file: the config to create, and the fields it states."""

    config: PoolConfig
    stated: tuple[str, ...]


@dataclass(frozen=True)
class Outcome:
    name: str
    action: str  # "created", "unchanged" or "differs"
    #: (field, the pool's value, the file's value) for each stated field that differs
    differences: tuple[tuple[str, object, object], ...] = ()


def _entry(item: object, where: str) -> Wanted:
    if not isinstance(item, dict):
        raise PoolFileError(f"{where} must be an object with the fields of a pool, got {type(item).__name__}")
    unknown = sorted(set(item) - set(_FIELDS))
    if unknown:
        raise PoolFileError(f"{where}: unknown field(s) {', '.join(unknown)}; a pool has {', '.join(_FIELDS)}")
    missing = [name for name in _REQUIRED if name not in item]
    if missing:
        raise PoolFileError(f"{where}: missing field(s) {', '.join(missing)}")
    for key, value in item.items():
        kind = _TYPES.get(str(_FIELDS[key]))
        if kind is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise PoolFileError(f"{where}: {key} must be {'a string' if kind is str else 'an integer'}, "
                                f"got {value!r}")
    try:
        config = PoolConfig(**item)
        check_config(config)
    except BlockdError as err:
        raise PoolFileError(f"{where}: {err}") from None
    return Wanted(config, tuple(item))


def parse(text: str, source: str = "the file") -> list[Wanted]:
    """The pools ``text`` (JSON) asks for; :class:`PoolFileError` if it is not valid."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise PoolFileError(f"{source} is not JSON: {err}") from None
    except RecursionError:  # json's decoder recurses per nesting level
        raise PoolFileError(f"{source} nests too deeply to be a pools file") from None
    items = data.get("pools") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise PoolFileError(f'{source} must hold {{"pools": [...]}} or a list of pools')
    wanted = [_entry(item, f"{source}: pool #{i + 1}") for i, item in enumerate(items)]
    names = [w.config.name for w in wanted]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise PoolFileError(f"{source} lists pool(s) {', '.join(repeated)} more than once")
    return wanted


def load(path: str) -> list[Wanted]:
    """The pools of file ``path`` (``-``: standard input)."""
    try:
        if path == "-":
            return parse(sys.stdin.read(), "standard input")
        with open(path, encoding="utf-8") as f:
            return parse(f.read(), path)
    except OSError as err:
        raise PoolFileError(f"cannot read {path}: {err.strerror or err}") from None


def compare(actual: PoolConfig, wanted: Wanted) -> Outcome:
    differences = tuple((name, getattr(actual, name), getattr(wanted.config, name))
                        for name in wanted.stated if getattr(actual, name) != getattr(wanted.config, name))
    return Outcome(actual.name, "differs" if differences else "unchanged", differences)


def apply(client, wanted: list[Wanted]) -> list[Outcome]:
    """Create what is missing, compare what is there (``client``: a
    :class:`client.sdk.BlockdClient`). RPC failures other than the two
    handled here propagate as the SDK's exceptions."""
    outcomes = []
    for item in wanted:
        try:
            actual = client.pool_config(item.config.name)
        except NotFoundError:
            try:
                client.create_pool(item.config)
                outcomes.append(Outcome(item.config.name, "created"))
                continue
            except AlreadyExistsError:  # created meanwhile by someone else: compare with theirs
                actual = client.pool_config(item.config.name)
        outcomes.append(compare(actual, item))
    return outcomes


__all__ = ["Outcome", "PoolFileError", "Wanted", "apply", "compare", "load", "parse"]
