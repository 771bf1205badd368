"""``Allocate.share_seq_id`` over real gRPC: a prompt takes the blocks of a
sequence allocated beside it in the same batch (as far as their tokens agree,
within ``share_tokens``), counted as cached but not published until committed;
bad input (an unknown sequence, a count out of range, an over-long id) is
refused with a clear status and changes nothing."""

from __future__ import annotations

import json

import pytest

from blockd.core import Allocate, Commit, Free, PoolConfig
from client.errors import InvalidArgumentError, NotFoundError
from client.sdk import BlockdClient

pytest_plugins = ["tests.support.grpc_fixtures"]

SHARED = list(range(1, 9))  # two full blocks of 4


def _state(client: BlockdClient) -> str:
    stats = client.get_pool("p")
    return json.dumps([stats.version, stats.num_used_blocks, stats.num_seqs, client.get_tables("p"),
                       client.lookup_prefix([*SHARED, 0], None, ["p"])])


def test_a_prompt_takes_blocks_of_one_allocated_beside_it(client, blockd_server) -> None:
    client.create_pool(PoolConfig("p", num_blocks=16, block_size=4))
    result = client.step("p", [Allocate("a", [*SHARED, 50]),
                               Allocate("b", [*SHARED, 60], share_seq_id="a", share_tokens=8),
                               Allocate("c", [*SHARED[:4], 9, 9, 9, 9, 70], share_seq_id="a", share_tokens=8)])
    _, b, c = result.results
    assert (b.num_cached_tokens, b.slot_start, len(b.slot_mapping)) == (8, 8, 1)
    assert c.num_cached_tokens == 4  # its second block differs from a's: only the first is taken
    tables = client.get_tables("p")[1]
    assert tables["b"][:2] == tables["a"][:2] and tables["c"][:1] == tables["a"][:1]
    assert client.lookup_prefix([*SHARED, 0], None, ["p"]) == {"p": 0}, "a share publishes nothing"
    client.step("p", [Commit("a", 9)])
    assert client.lookup_prefix([*SHARED, 0], None, ["p"]) == {"p": 8}
    client.step("p", [Free("a"), Commit("b", 9), Free("b"), Free("c")])
    assert client.get_pool("p").num_used_blocks == 0


def test_bad_shares_are_refused_and_change_nothing(client, blockd_server) -> None:
    client.create_pool(PoolConfig("p", num_blocks=16, block_size=4))
    client.step("p", [Allocate("a", [*SHARED, 50])])
    before = _state(client)
    for ops, error, words in [
        ([Allocate("b", SHARED, share_seq_id="nope", share_tokens=8)], NotFoundError, "nope"),
        ([Allocate("b", SHARED, share_seq_id="a", share_tokens=1 << 40)], InvalidArgumentError,
         "share_tokens must be an integer"),
        ([Allocate("b", SHARED, share_seq_id="x" * 300)], InvalidArgumentError, "share_seq_id"),
        ([Allocate("b", SHARED, share_seq_id="b")], NotFoundError, "'b'"),  # not itself: it does not exist yet
    ]:
        with pytest.raises(error) as err:
            client.step("p", ops)
        assert words in err.value.message, err.value.message
        assert _state(client) == before
