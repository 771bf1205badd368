"""Environment variables for command-line flags, derived from the flags themselves.

The three console scripts (``blockd``, ``blockd-worker``, ``blockctl``) build an
``argparse`` parser and hand it to :func:`parse_args` with a prefix. Every
optional flag then has an environment variable, named from the flag by one
rule (:func:`env_name`: prefix + flag name, upper case, ``-`` -> ``_``), read
with the flag's own ``type`` and ``choices``:

    --metrics-port  (prefix BLOCKD_WORKER_)  ->  BLOCKD_WORKER_METRICS_PORT

Precedence: a flag on the command line, then the variable, then the flag's
default. A variable satisfies a ``required=True`` flag. ``store_true`` flags
read ``1/true/yes/on`` and ``0/false/no/off``. ``--help`` names each flag's
variable. A variable that does not parse ends the program with one line
(``blockd-worker: BLOCKD_WORKER_METRICS_PORT must be an integer, got 'abc'``)
and exit status 2, as a bad flag does -- never a traceback.

A few flags keep an established name shared by several programs (e.g.
``--target``/``--blockd`` both read ``BLOCKD_TARGET``); the caller passes
those as ``overrides``. Flags and variables of subcommands are handled the
same way, and the variables of subcommands use the same prefix (one flag
name, one meaning, whichever command has it).

Standard library only: imported by the daemon, the worker and the client
alike, so it lives in ``blockd/`` beside the core and imports nothing of
this project.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
_TYPE_WORDS = {int: "an integer", float: "a number"}


class EnvError(ValueError):
    """An environment variable whose value its flag does not accept."""


class _FromEnv:
    """A flag's default that stands for an environment variable, converted
    after parsing (so ``--help`` works whatever the environment holds, and a
    flag on the command line wins without the variable being read)."""

    __slots__ = ("action", "name", "raw")

    def __init__(self, action: argparse.Action, name: str, raw: str) -> None:
        self.action, self.name, self.raw = action, name, raw

    def __repr__(self) -> str:  # shown by --help's %(default)s
        return f"${self.name}"


#: what ``--log-level`` takes, in every program
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(text: str) -> str:
    """A flag type: a :mod:`logging` level name, any case."""
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)}")
    return text.upper()


def cpu_list(text: str) -> frozenset[int]:
    """A flag type: CPU numbers as ``taskset -c`` takes them (``0``, ``0-3``, ``0,2-3``)."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or (dash and int(high) < int(low)):
            # the bad part is named only when it is not the whole text: a variable's
            # error already ends with ", got <text>"
            which = f"; {part!r} is not one" if part != text.strip() else ""
            raise argparse.ArgumentTypeError(f"must be CPU numbers such as 0, 0-3 or 0,2-3{which}")
        cpus.update(range(int(low), int(high if dash else low) + 1))
    return frozenset(cpus)


def positive_int_list(text: str) -> tuple[int, ...]:
    """A flag type: comma-separated integers >= 1 (``16,32,64``), sorted, each once."""
    try:
        values = {int(part) for part in text.split(",")}
    except ValueError:
        values = set()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("must be comma-separated integers >= 1, such as 16,32,64")
    return tuple(sorted(values))


def port(text: str) -> int:
    """A flag type: a TCP port number, 0 included (0: off, or any free port)."""
    if not text.strip().isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError("must be a port number in 0..65535")
    return int(text)


def _number(text: str, kind: type, lowest: float, inclusive: bool, what: str) -> Any:
    """``text`` as a finite ``kind`` at or above (``inclusive``) / above ``lowest``;
    ``ArgumentTypeError`` naming the range otherwise. argparse prefixes the flag
    (``argument --fsync-interval-s: must be ...``), :func:`convert` the variable."""
    try:
        value = kind(text)
    except (ValueError, TypeError, OverflowError):
        raise argparse.ArgumentTypeError(f"must be {what}") from None
    if not math.isfinite(value) or value < lowest or (value == lowest and not inclusive):
        raise argparse.ArgumentTypeError(f"must be {what}")
    return value


# Every numeric flag of the three programs takes one of these (or :func:`port`), so
# a value out of range, from the flag or its variable, is refused at parse time
# with the range in the message: an interval of 0 once made the daemon spin.

def positive_float(text: str) -> float:
    """A flag type: a finite number > 0 (an interval, a timeout)."""
    return float(_number(text, float, 0.0, False, "a number > 0"))


def non_negative_float(text: str) -> float:
    """A flag type: a finite number >= 0 (0 usually meaning off or none)."""
    return float(_number(text, float, 0.0, True, "a number >= 0"))


def positive_int(text: str) -> int:
    """A flag type: an integer >= 1 (a count, a bound)."""
    return int(_number(text, int, 1, True, "an integer >= 1"))


def non_negative_int(text: str) -> int:
    """A flag type: an integer >= 0 (0 usually meaning off or unbounded)."""
    return int(_number(text, int, 0, True, "an integer >= 0"))


def env_name(prefix: str, option: str) -> str:
    """``env_name("BLOCKD_WORKER_", "--metrics-port") == "BLOCKD_WORKER_METRICS_PORT"``."""
    return prefix + option.lstrip("-").upper().replace("-", "_")


def _long_option(action: argparse.Action) -> str | None:
    longs = [o for o in action.option_strings if o.startswith("--")]
    return longs[0] if longs else None


def _flag_name(action: argparse.Action) -> str:
    """The long option of an action :func:`_flag_actions` yields (it has one)."""
    option = _long_option(action)
    assert option is not None, "flag actions have a long option"
    return option


def _flag_actions(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """Every optional flag of ``parser`` and of its subcommands, depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases map to one parser
                yield from _flag_actions(sub)
        elif action.option_strings and _long_option(action) and action.dest != argparse.SUPPRESS \
                and not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield action


def flag_env_names(parser: argparse.ArgumentParser, prefix: str,
                   overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{"--flag": "ENV_NAME"}`` for every flag ``parser`` (and its subcommands) has."""
    overrides = overrides or {}
    names: dict[str, str] = {}
    for action in _flag_actions(parser):
        option = _flag_name(action)
        names[option] = overrides.get(option) or env_name(prefix, option)
    return names


def convert(action: argparse.Action, name: str, raw: str):
    """``raw`` read as ``action`` reads its argument; :class:`EnvError` if it cannot be."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        word = raw.strip().lower()
        if word not in _TRUE + _FALSE:
            raise EnvError(f"{name} must be a boolean (1/0, true/false, yes/no, on/off), got {raw!r}")
        is_set = word in _TRUE
        return is_set if isinstance(action, argparse._StoreTrueAction) else not is_set
    if action.nargs == 0:
        raise EnvError(f"{name} cannot be set from the environment")
    kind: Any = action.type  # a callable, or None for a plain string
    try:
        value = kind(raw) if kind is not None else raw
    except (ValueError, TypeError, argparse.ArgumentTypeError) as err:
        what = _TYPE_WORDS.get(kind)
        if what is not None:
            raise EnvError(f"{name} must be {what}, got {raw!r}") from None
        text = str(err)
        raise EnvError(f"{name} {text}, got {raw!r}" if text.startswith("must ")
                       else f"{name}: {text} (got {raw!r})") from None
    if action.choices is not None and value not in action.choices:
        raise EnvError(f"{name} must be one of {', '.join(map(str, action.choices))}, got {raw!r}")
    return value


def _default_note(action: argparse.Action) -> str:
    """`` (default: X)`` for ``--help``, unless the flag has none worth saying
    (off, unset, a switch) or its help already gives it."""
    default = action.default
    if default in (None, False, "", argparse.SUPPRESS) or action.nargs == 0 or "default" in (action.help or ""):
        return ""
    return f" (default: {str(default).replace('%', '%%')})"


def install(parser: argparse.ArgumentParser, prefix: str, overrides: Mapping[str, str] | None = None,
            environ: Mapping[str, str] | None = None) -> None:
    """Name each flag's variable in its help, and make the variables that are
    set the flags' defaults (converted by :func:`resolve` after parsing)."""
    environ = os.environ if environ is None else environ
    names = flag_env_names(parser, prefix, overrides)
    for action in _flag_actions(parser):
        name = names[_flag_name(action)]
        if action.help != argparse.SUPPRESS:
            action.help = f"{action.help or ''}{_default_note(action)} [env {name}]".strip()
        # a flag without a default (argparse.SUPPRESS) repeats one given elsewhere
        # (e.g. after a subcommand): the variable backs that one, not this
        if name in environ and action.default is not argparse.SUPPRESS:
            action.default = _FromEnv(action, name, environ[name])
            action.required = False


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Convert every value that still stands for a variable; :class:`EnvError` on a bad one."""
    for dest, value in vars(args).items():
        if isinstance(value, _FromEnv):
            setattr(args, dest, convert(value.action, value.name, value.raw))
    return args


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None, prefix: str,
               overrides: Mapping[str, str] | None = None,
               environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with every flag backed by its environment
    variable. A bad variable prints one line and exits with status 2."""
    install(parser, prefix, overrides, environ)
    args = parser.parse_args(argv)
    try:
        return resolve(args)
    except EnvError as err:
        print(f"{parser.prog}: {err}", file=sys.stderr)
        raise SystemExit(2) from None


__all__ = ["LOG_LEVELS", "EnvError", "convert", "env_name", "flag_env_names", "install", "log_level",
           "non_negative_float", "non_negative_int", "parse_args", "port", "positive_float", "positive_int",
           "resolve"]
