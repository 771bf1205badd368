"""Every shell and Python block of README.md and docs/ runs as written (:mod:`tests.support.docs_runner`).

One test per page: its runnable blocks run top to bottom in a fresh
directory, against the daemons (and etcd) the blocks themselves start, on
ports free now. A block that is not meant to run says why in a
``<!-- not run: REASON -->`` comment above it; the runner's own tests below
prove that a failing block fails its page and that nothing a page started
outlives it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.support import docs_runner
from tests.support.etcd import require_etcd

PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in Path(ROOT, "docs").glob("*.md"))]
#: the pages' excluded blocks, counted, so that a new exclusion is a decision made here
MAX_NOT_RUN = 8


@pytest.mark.parametrize("page", PAGES)
def test_the_page_runs_as_written(page: str, tmp_path: Path) -> None:
    try:
        docs_runner.run_page(ROOT, Path(ROOT, page), tmp_path)
    except docs_runner.Unavailable as why:
        require_etcd()  # fails with BLOCKD_REQUIRE_ETCD=1, skips otherwise
        pytest.skip(str(why))
    except docs_runner.Failure as failure:
        pytest.fail(str(failure), pytrace=False)


def all_blocks() -> list[docs_runner.Block]:
    return [b for page in PAGES for b in docs_runner.blocks(Path(ROOT, page).read_text(), page)]


def test_every_excluded_block_says_why_and_they_are_few() -> None:
    shell_or_python = [b for b in all_blocks() if b.kind in docs_runner.RUN_KINDS]
    excluded = [b for b in shell_or_python if b.not_run is not None]
    assert all(len(b.not_run or "") >= 10 for b in excluded), [b.where() for b in excluded]
    assert len(excluded) <= MAX_NOT_RUN, [f"{b.where()}: {b.not_run}" for b in excluded]
    assert len(shell_or_python) - len(excluded) >= 8, "the docs should have runnable blocks"


def test_command_blocks_say_their_language() -> None:
    """A plain fence is never run: one holding commands would escape the runner."""
    commands = (".venv/bin/", "blockd ", "blockctl ")
    unlabelled = [b.where() for b in all_blocks() if b.kind == ""
                  and any(line.lstrip().startswith(commands) for line in b.text.splitlines())]
    assert not unlabelled, unlabelled


def _page(tmp_path: Path, text: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(text)
    return page


def test_a_failing_block_fails_its_page_naming_the_line(tmp_path: Path) -> None:
    page = _page(tmp_path, "intro\n\n```sh\necho one\nfalse\necho never\n```\n")
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(docs_runner.Failure) as raised:
        docs_runner.run_page(ROOT, page, work)
    assert raised.value.status == 1 and raised.value.block.line == 3
    assert "one" in raised.value.output and "never" not in raised.value.output
    assert "page.md:3" in str(raised.value)


def test_a_failing_python_block_fails_and_excluded_blocks_do_not_run(tmp_path: Path) -> None:
    page = _page(tmp_path, "<!-- not run: it would fail, on purpose -->\n```sh\nexit 3\n```\n\n"
                           "```python\nraise SystemExit(4)\n```\n")
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(docs_runner.Failure) as raised:
        docs_runner.run_page(ROOT, page, work)
    assert raised.value.status == 4 and raised.value.block.kind == "python"


def test_what_a_page_leaves_running_is_stopped_and_ports_are_stand_ins(tmp_path: Path) -> None:
    page = _page(tmp_path, "```sh\nsleep 300 &\necho $! > sleeper.pid\n"
                           "echo \"127.0.0.1:50051 $BLOCKD_TARGET --metrics-port 9400\" > ports.txt\n```\n"
                           "```python\nimport os\nprint(os.environ['HOME'] == os.getcwd())\n```\n")
    work = tmp_path / "work"
    work.mkdir()
    run = docs_runner.run_page(ROOT, page, work)
    assert len(run.ran) == 2
    pid = int((work / "sleeper.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    address, target, _flag, metrics = (work / "ports.txt").read_text().split()
    assert address == target and address != "127.0.0.1:50051" and metrics != "9400"
    assert (work / ".block-2.out").read_text().strip() == "True"
