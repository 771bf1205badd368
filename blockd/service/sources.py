"""Cross-pool sharing in a cluster of daemon groups: an ``Allocate``'s source pool
that another group serves is refused before the step (:func:`source_refusal`).

Prefixes are shared through one daemon's ledger (:mod:`blockd.engine.transfers`
plans the transfer from the source pool's state), so a source pool in another
group cannot be read here. Without this check the engine would answer
``SOURCE_POOL_NOT_FOUND`` as for a pool that does not exist; this says where the
pool is and what to do (``SOURCE_IN_OTHER_GROUP``, FAILED_PRECONDITION, naming
the op; nothing applied). The scheduler steps on without the source for a while
(:mod:`client.faults`). Imports the core's errors and nothing of gRPC.
"""

from __future__ import annotations

from typing import Any

from blockd.core.errors import BlockdError, SourceInOtherGroup, WrongGroup, shown


def source_refusal(member: Any, request: Any) -> BlockdError | None:
    """The refusal of a ``StepRequest`` naming, in an ``Allocate``, a source pool another group
    owns (or the directory's failure to say), or None. ``member``: the daemon's
    :class:`~blockd.service.groups.GroupMember` (its ``owned`` pools, ``refusal``, ``group``)."""
    owned = member.owned
    for index, op in enumerate(request.ops):
        if op.WhichOneof("kind") != "allocate" or not op.allocate.source_pool or op.allocate.source_pool in owned:
            continue
        name = op.allocate.source_pool
        refusal = member.refusal(name)  # reads etcd; None: ours after all, or in no group (the engine says)
        if isinstance(refusal, WrongGroup):
            group, address = refusal.metadata["owner_group"], refusal.metadata["owner_address"]
            return SourceInOtherGroup(
                f"operation {index} (allocate): source_pool {shown(name)} is served by group {group}, not group "
                f"{member.group}: pools share prefixes only within one group; nothing was applied. Move one of "
                f"the two pools to the other's group (blockctl pools move), or name no source pool (the "
                f"scheduler then computes those prompts)", op_index=index, group=group, address=address)
        if refusal is not None:
            return refusal  # the directory did not answer (UNAVAILABLE): retry
    return None
