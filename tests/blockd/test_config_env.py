"""Environment variables for flags (:mod:`blockd.config_env`): the one rule
that names them, precedence, typed parsing, one-line errors; and that every
flag of ``blockd serve``, ``blockd-worker`` and ``blockctl`` really has one."""

from __future__ import annotations

import argparse

import pytest

from blockd import config_env
from blockd.cli import build_parser as blockd_parser
from blockd.cli import data_dir_path, listen_address
from client.cli import ENV_OVERRIDES as BLOCKCTL_OVERRIDES
from client.cli import build_parser as blockctl_parser
from worker.main import ENV_OVERRIDES as WORKER_OVERRIDES
from worker.main import build_parser as worker_parser

pytest_plugins = ["tests.support.grpc_fixtures"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prog")
    p.add_argument("--count", type=int, default=3)
    p.add_argument("--rate-s", type=float, default=0.5)
    p.add_argument("--mode", choices=("a", "b"), default="a")
    p.add_argument("--name", required=True)
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--port", type=config_env.port, default=0)
    return p


def parse(argv: list[str], environ: dict[str, str]) -> argparse.Namespace:
    return config_env.parse_args(parser(), argv, "P_", environ=environ)


def test_names_come_from_the_flag() -> None:
    assert config_env.env_name("BLOCKD_WORKER_", "--metrics-port") == "BLOCKD_WORKER_METRICS_PORT"
    assert config_env.flag_env_names(parser(), "P_", {"--name": "SHARED_NAME"}) == {
        "--count": "P_COUNT", "--rate-s": "P_RATE_S", "--mode": "P_MODE", "--name": "SHARED_NAME",
        "--verbose": "P_VERBOSE", "--port": "P_PORT"}


def test_flag_then_variable_then_default() -> None:
    env = {"P_COUNT": "7", "P_RATE_S": "1.5", "P_MODE": "b", "P_NAME": "from-env", "P_VERBOSE": "yes"}
    args = parse([], env)  # the variable satisfies the required --name
    assert (args.count, args.rate_s, args.mode, args.name, args.verbose) == (7, 1.5, "b", "from-env", True)
    args = parse(["--count", "9", "--name", "flag"], env)
    assert (args.count, args.name) == (9, "flag")
    args = parse(["--name", "n"], {})
    assert (args.count, args.rate_s, args.mode, args.verbose, args.port) == (3, 0.5, "a", False, 0)
    assert parse(["--name", "n"], {"P_VERBOSE": "off"}).verbose is False


@pytest.mark.parametrize(("name", "raw", "message"), [
    ("P_COUNT", "abc", "prog: P_COUNT must be an integer, got 'abc'"),
    ("P_RATE_S", "fast", "prog: P_RATE_S must be a number, got 'fast'"),
    ("P_MODE", "c", "prog: P_MODE must be one of a, b, got 'c'"),
    ("P_VERBOSE", "maybe", "prog: P_VERBOSE must be a boolean (1/0, true/false, yes/no, on/off), got 'maybe'"),
    ("P_PORT", "70000", "prog: P_PORT must be a port number in 0..65535, got '70000'"),
])
def test_a_bad_variable_is_one_line_and_exit_2(capsys, name, raw, message) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(["--name", "n"], {name: raw})
    assert exc.value.code == 2
    assert capsys.readouterr().err == message + "\n"


def test_a_flag_on_the_command_line_wins_over_a_bad_variable() -> None:
    assert parse(["--name", "n", "--count", "4"], {"P_COUNT": "abc"}).count == 4


def test_help_works_and_names_each_variable_whatever_the_environment(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(["--help"], {"P_COUNT": "abc"})
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert all(f"[env {name}]" in out for name in ("P_COUNT", "P_RATE_S", "P_MODE", "P_NAME", "P_VERBOSE"))


def _sample(action: argparse.Action) -> tuple[str, object]:
    """A value for ``action`` other than its default, as text and as parsed."""
    if isinstance(action, argparse._StoreTrueAction):
        return "1", True
    if action.choices:
        choice = next(c for c in action.choices if c != action.default)
        return str(choice), choice
    if action.type is listen_address:
        return "127.0.0.1:7", "127.0.0.1:7"
    if action.type is config_env.log_level:
        return "debug", "DEBUG"
    if action.type is config_env.cpu_list:
        return "0,2-3", frozenset({0, 2, 3})
    if action.type is config_env.positive_int_list:
        return "8,4", (4, 8)
    if action.type in (int, config_env.port, config_env.positive_int, config_env.non_negative_int):
        return "7", 7
    if action.type in (float, config_env.positive_float, config_env.non_negative_float):
        return "0.25", 0.25
    return "some-value", "some-value"


def _serve_parser() -> argparse.ArgumentParser:
    return next(a for a in blockd_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]


#: program -> (its parser, the part with the flags, prefix, overrides, argv, environment it needs)
PROGRAMS = {
    "blockd serve": (blockd_parser, _serve_parser, "BLOCKD_", {}, ["serve"], {}),
    "blockd-worker": (worker_parser, worker_parser, "BLOCKD_WORKER_", WORKER_OVERRIDES, [], {"BLOCKD_POOL": "p"}),
}


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_every_flag_of_the_daemon_and_the_worker_reads_its_variable(program) -> None:
    full, flags, prefix, overrides, argv, needed = PROGRAMS[program]
    names = config_env.flag_env_names(flags(), prefix, overrides)
    assert len(names) >= 10
    for option, name in names.items():
        action = next(a for a in flags()._actions if option in a.option_strings)
        raw, value = _sample(action)
        args = config_env.parse_args(full(), argv, prefix, overrides, environ={**needed, name: raw})
        assert getattr(args, action.dest) == value, (option, name)


def test_every_flag_of_blockctl_reads_its_variable() -> None:
    names = config_env.flag_env_names(blockctl_parser(), "BLOCKCTL_", BLOCKCTL_OVERRIDES)
    assert names["--target"] == "BLOCKD_TARGET" and names["--num-blocks"] == "BLOCKCTL_NUM_BLOCKS"
    cases = {"--target": ["pools", "list"], "--json": ["pools", "list"], "--timeout-s": ["pools", "list"],
             "--num-blocks": ["pools", "create", "x", "--block-size", "4"],
             "--block-size": ["pools", "create", "x", "--num-blocks", "4"],
             "--from": ["events", "tail", "p"], "--follow": ["events", "tail", "p"],
             "--interval": ["top"], "--pool": ["workers", "list"], "--service": ["health"]}
    for option, argv in cases.items():
        p = blockctl_parser()
        actions = [a for leaf in [p, *_all_parsers(p)] for a in leaf._actions if option in a.option_strings
                   and a.default is not argparse.SUPPRESS]
        raw, value = _sample(actions[0])
        args = config_env.parse_args(p, argv, "BLOCKCTL_", BLOCKCTL_OVERRIDES, environ={names[option]: raw})
        assert getattr(args, actions[0].dest) == value, option
    # every flag of every command is named, and one name has one meaning
    assert {"--dtype", "--watermark-blocks", "--limit", "--once"} <= set(names)


def _all_parsers(p: argparse.ArgumentParser):
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield child
                yield from _all_parsers(child)


@pytest.mark.parametrize(("module", "args", "env", "message"), [
    ("worker.main", [], {"BLOCKD_POOL": "p", "BLOCKD_WORKER_METRICS_PORT": "abc"},
     "blockd-worker: BLOCKD_WORKER_METRICS_PORT must be a port number in 0..65535, got 'abc'"),
    ("worker.main", ["--pool", "p"], {"BLOCKD_WORKER_TP_RANK": "first"},
     "blockd-worker: BLOCKD_WORKER_TP_RANK must be an integer >= 0, got 'first'"),
    ("blockd.cli", ["serve"], {"BLOCKD_FSYNC_INTERVAL_S": "soon"},
     "blockd: BLOCKD_FSYNC_INTERVAL_S must be a number > 0, got 'soon'"),
    # a zero or negative interval once made the idle daemon spin at 100% CPU
    ("blockd.cli", ["serve"], {"BLOCKD_FSYNC_INTERVAL_S": "-1"},
     "blockd: BLOCKD_FSYNC_INTERVAL_S must be a number > 0, got '-1'"),
    ("worker.main", ["--pool", "p"], {"BLOCKD_WORKER_HEARTBEAT_S": "0"},
     "blockd-worker: BLOCKD_WORKER_HEARTBEAT_S must be a number > 0, got '0'"),
    ("worker.main", ["--pool", "p"], {"BLOCKD_WORKER_COMPILE_BUCKETS": "0,16"},
     ("blockd-worker: BLOCKD_WORKER_COMPILE_BUCKETS must be comma-separated integers >= 1, such as 16,32,64, "
      "got '0,16'")),
    ("blockd.cli", ["serve"], {"BLOCKD_CPUS": "all"},
     "blockd: BLOCKD_CPUS must be CPU numbers such as 0, 0-3 or 0,2-3, got 'all'"),
    ("blockd.cli", ["serve"], {"BLOCKD_LOG_LEVEL": "loud"},
     "blockd: BLOCKD_LOG_LEVEL must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got 'loud'"),
])
def test_the_programs_print_one_line_not_a_traceback(run_module, module, args, env, message) -> None:
    proc = run_module(module, *args, env=env)
    assert proc.returncode == 2 and proc.stderr == message + "\n" and proc.stdout == ""


def test_a_zero_fsync_interval_on_the_command_line_is_a_usage_error(run_module) -> None:
    proc = run_module("blockd.cli", "serve", "--fsync-interval-s", "0")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines()[-1] == "blockd serve: error: argument --fsync-interval-s: must be a number > 0"


NUMERIC_TYPES = (config_env.positive_float, config_env.non_negative_float, config_env.positive_int,
                 config_env.non_negative_int, config_env.port)


def _numeric_flags(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for leaf in [p, *_all_parsers(p)] for a in leaf._actions
            if a.option_strings and a.type is not None
            and a.type not in (str, config_env.log_level, config_env.cpu_list, config_env.positive_int_list,
                                   listen_address, data_dir_path)]


@pytest.mark.parametrize("program", ["blockd", "blockd-worker"])
def test_every_numeric_flag_takes_a_ranged_type(program) -> None:
    """The one place ranges are checked: a bare ``int``/``float`` would accept -1."""
    p = blockd_parser() if program == "blockd" else worker_parser()
    loose = [a.option_strings[0] for a in _numeric_flags(p) if a.type not in NUMERIC_TYPES]
    assert not loose, f"{program}: numeric flags without a range: {loose}"


def test_every_numeric_flag_of_serve_refuses_a_negative_value(capsys) -> None:
    actions = _numeric_flags(_serve_parser())
    assert len(actions) >= 20
    names = config_env.flag_env_names(_serve_parser(), "BLOCKD_")
    for action in actions:
        option = action.option_strings[0]
        with pytest.raises(SystemExit) as exc:
            config_env.parse_args(blockd_parser(), ["serve", option, "-1"], "BLOCKD_", environ={})
        err = capsys.readouterr().err.splitlines()[-1]
        assert exc.value.code == 2 and err.startswith(f"blockd serve: error: argument {option}: must be "), err
        assert any(word in err for word in ("> 0", ">= 0", ">= 1", "0..65535")), err
        with pytest.raises(SystemExit) as exc:
            config_env.parse_args(blockd_parser(), ["serve"], "BLOCKD_", environ={names[option]: "-1"})
        assert exc.value.code == 2
        assert capsys.readouterr().err.startswith(f"blockd: {names[option]} must be "), option


@pytest.mark.parametrize(("kind", "good", "bad"), [
    (config_env.positive_float, {"0.5": 0.5, "3": 3.0}, ["0", "-1", "nan", "inf", "x", ""]),
    (config_env.non_negative_float, {"0": 0.0, "2.5": 2.5}, ["-0.1", "nan", "-inf", "x"]),
    (config_env.positive_int, {"1": 1, " 42 ": 42}, ["0", "-3", "1.5", "x"]),
    (config_env.non_negative_int, {"0": 0, "9": 9}, ["-1", "1e3", "x"]),
])
def test_the_ranged_types(kind, good, bad) -> None:
    assert {text: kind(text) for text in good} == good
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match=r"^must be "):
            kind(text)


def test_help_shows_each_flags_default_beside_its_variable():
    from blockd.cli import build_parser

    parser = build_parser()
    config_env.install(parser, "BLOCKD_", environ={})
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    text = " ".join(serve.format_help().split())
    assert "batching interval for --fsync interval (default: 0.05) [env BLOCKD_FSYNC_INTERVAL_S]" in text
    assert "(default: 8192) [env BLOCKD_MAX_OPS_PER_STEP]" in text
    assert "(default: False)" not in text and "(default: None)" not in text
