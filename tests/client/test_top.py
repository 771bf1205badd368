"""``blockctl top`` (client.cli.top): frames from an in-process engine and over real gRPC."""

from __future__ import annotations

import io

import pytest

from blockd.core.types import Allocate, Commit, Free, PoolConfig, WorkerInfo
from blockd.engine.machine import Engine
from client.cli.top import add_top, prefix_hit_cell, render_frame, run_top, utilisation_bar

pytest_plugins = ["tests.support.grpc_fixtures"]


def test_utilisation_bar_is_bounded():
    assert utilisation_bar(0.0) == "[....................]   0.0%"
    assert utilisation_bar(0.25) == "[#####...............]  25.0%"
    assert utilisation_bar(1.0) == "[####################] 100.0%"
    assert utilisation_bar(1.7).startswith("[" + "#" * 20 + "]")


def _engine() -> Engine:
    engine = Engine()
    engine.create_pool(PoolConfig("llama", num_blocks=40, block_size=4))
    engine.create_pool(PoolConfig("empty", num_blocks=8, block_size=16))
    # first: a worker joining later would hold none of the KV (and the prefix cache would be cleared)
    engine.register_worker(WorkerInfo("w0", "llama", layer_end=1, kv_head_end=1, incarnation="i0"))
    engine.step("llama", [Allocate("a", list(range(10))), Commit("a", 10)])
    engine.step("llama", [Free("a"), Allocate("b", list(range(9)))])  # 8 tokens hit
    return engine


def test_once_prints_one_frame_with_every_column():
    engine = _engine()
    out = io.StringIO()
    # the engine answers the two SDK calls top makes, so it stands in for a client here
    assert run_top(engine, 1.0, True, out) == 1
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("blockd top") and "2 pools" in lines[0]
    assert lines[2].split()[:4] == ["POOL", "UTILISATION", "USED", "FREE"]
    empty, llama = lines[3], lines[4]
    assert empty.startswith("empty") and "0 up / 0 down" in empty
    stats = engine.get_pool("llama")
    cells = llama.split()
    assert cells[0] == "llama" and f"{stats.utilisation_ratio * 100:.1f}%" in llama
    assert f"{stats.tail_waste_slots} (" in llama
    assert "1 up / 0 down" in llama
    assert f"{stats.prefix_hit_tokens / stats.prefix_queried_tokens * 100:.1f}%" in llama
    assert "\x1b[" not in out.getvalue()  # no screen control codes when not a terminal


def test_live_mode_redraws_and_shows_the_recent_hit_rate():
    engine = _engine()
    out = io.StringIO()
    steps = iter([lambda: engine.step("llama", [Allocate("c", list(range(9)))])])

    def sleep(_seconds: float) -> None:
        next(steps)()  # between frames: one allocation that hits 8 of 9 tokens

    assert run_top(engine, 0.5, False, out, sleep=sleep, max_frames=2) == 2
    frames = out.getvalue().split("blockd top")[1:]
    assert len(frames) == 2
    assert "88.9%" in frames[1]  # 8/9 over the last interval, not the lifetime ratio


def test_prefix_hit_cell_without_queries():
    stats = Engine()
    stats.create_pool(PoolConfig("p", num_blocks=4, block_size=4))
    assert prefix_hit_cell(stats.get_pool("p"), None) == "-"


def test_no_pools_and_orphan_workers():
    frame = render_frame([], [], title="t")
    assert "no pools" in frame


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval"):
        run_top(Engine(), 0, False, io.StringIO())


def test_top_over_real_grpc(client):
    client.create_pool(PoolConfig("remote", num_blocks=16, block_size=4))
    client.allocate("remote", "s", [1, 2, 3, 4, 5])
    out = io.StringIO()
    run_top(client, 1.0, True, out)
    row = next(line for line in out.getvalue().splitlines() if line.startswith("remote"))
    cells = row.split()
    assert cells[3:6] == ["2", "14", "0"]  # used, free, evictable
    assert "3 (37.5%)" in row  # 3 of the 8 slots of the 2 used blocks are empty


def test_add_top_registers_the_subcommand():
    import argparse

    parser = argparse.ArgumentParser()
    add_top(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["top", "--once", "--interval", "3"])
    assert args.once and args.interval == 3.0 and callable(args.run)


def test_tiers_and_misses_by_reason():
    engine = Engine()
    engine.create_pool(PoolConfig("tiered", num_blocks=4, block_size=4, num_host_blocks=4))
    engine.register_worker(WorkerInfo("w0", "tiered", layer_end=1, kv_head_end=1, incarnation="i0"))
    # three cached blocks, pushed to the host tier by another prompt, then hit there
    for ops in ([Allocate("a", list(range(12))), Commit("a", 12)], [Free("a")],
                [Allocate("b", list(range(100, 113)))], [Free("b")], [Allocate("c", list(range(12)))]):
        engine.step("tiered", ops)
    stats = engine.get_pool("tiered")
    assert stats.num_offloads and stats.num_restores, "the steps above moved blocks between the tiers"
    out = io.StringIO()
    run_top(engine, 1.0, True, out)
    lines = out.getvalue().splitlines()
    header = next(line for line in lines if line.startswith("POOL") and "HOST CACHED" in line)
    row = lines[lines.index(header) + 1].split()
    assert header.split()[1:5] == ["DEV", "CACHED", "HOST", "CACHED"]
    misses = stats.prefix_miss_by_reason
    assert row == ["tiered", str(stats.num_evictable_blocks), str(stats.num_host_cached_blocks), "/", "4",
                   str(stats.num_offloads), str(stats.num_restores),
                   *(str(misses[r]) for r in ("never_stored", "evicted_device", "evicted_host", "partial",
                                               "other_extra_keys"))]
    assert misses["never_stored"] and misses["partial"]


class Terminal(io.StringIO):
    """Output that says it is a terminal (of the size get_terminal_size is patched to)."""

    def isatty(self) -> bool:
        return True


def test_one_screen_with_a_long_pool_name_over_real_grpc(client, monkeypatch):
    import os

    from client.cli import top

    long_name = "tenant-a-" + "x" * 100 + "-pool-7"
    for name in ("short", long_name):
        client.create_pool(PoolConfig(name, num_blocks=16, block_size=4))
        client.allocate(name, "s", [1, 2, 3, 4, 5])
    frames = {}
    for columns, lines in ((80, 24), (200, 50)):
        monkeypatch.setattr(top.shutil, "get_terminal_size", lambda c=columns, n=lines: os.terminal_size((c, n)))
        out = Terminal()
        run_top(client, 1.0, True, out)
        text = out.getvalue().removeprefix(top.CLEAR)
        frames[columns] = text.splitlines()
        assert len(frames[columns]) < lines and all(len(line) <= columns for line in frames[columns])
    wide = frames[200]
    shown = top.short_name(long_name)
    assert len(shown) == top.NAME_WIDTH and shown.startswith("tenant-a-") and shown.endswith("-pool-7")
    # the long name moves no column: both pools' cells line up under the headers, in both tables
    for header in (wide[2], wide[6]):
        rows = wide[wide.index(header) + 1 : wide.index(header) + 3]
        assert [r.split()[0] for r in rows] == ["short", shown]
        second = header.index(header.split()[1])
        assert second == top.NAME_WIDTH + 2  # the name column is as wide as a shortened name, no wider
        assert all(r[second - 2 : second] == "  " and r[second] != " " for r in rows)
    # a short terminal: the pools it cannot hold are counted, the title stays
    monkeypatch.setattr(top.shutil, "get_terminal_size", lambda: os.terminal_size((80, 9)))
    out = Terminal()
    run_top(client, 1.0, True, out)
    short = out.getvalue().removeprefix(top.CLEAR).splitlines()
    assert short[0].startswith("blockd top") and short[-1].startswith("... 1 more pools") and len(short) < 9


def test_q_quits_on_a_terminal():
    import os

    from client.cli.top import key_reader

    leader, follower = os.openpty()
    with os.fdopen(follower, "r") as stream, key_reader(stream) as wait:
        assert wait(0.05) is False  # nothing typed: it just waits
        os.write(leader, b"x")
        assert wait(0.05) is False  # another key is not q
        os.write(leader, b"q")
        assert wait(5.0) is True
    os.close(leader)
