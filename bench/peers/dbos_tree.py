"""The tree and the chain on DBOS: a workflow per node, a step per model call.

The planner workflow starts one child workflow per lead, each lead one child workflow per
writer; a writer's model call is a step, and so is the planner's aggregate call. A chain
level is a workflow whose step is its call and whose child workflow is the next level.
DBOS checkpoints every workflow's start and every step's output in its system database
(the ``dbos`` schema); after a crash, ``DBOS.launch()`` recovers the pending workflows of
this executor, and each skips the steps whose outputs are recorded.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

from dbos import DBOS, SetWorkflowID

from bench.peers.shape import Chat, Shape, link_prompt, planner_prompt, writer_prompt

_chat: list[Chat] = []  # the model client, set by setup (steps take serializable arguments)


@DBOS.step()
async def call_model(prompt: str) -> str:
    """One model call, checkpointed."""
    return await _chat[0](prompt)


@DBOS.workflow()
async def writer(lead: int, part: int) -> str:
    """A writer: one call."""
    return await call_model(writer_prompt(lead, part))


@DBOS.workflow()
async def lead(index: int, writers: int) -> dict[str, int]:
    """A lead: its writers as child workflows."""
    handles = [await DBOS.start_workflow_async(writer, index, j) for j in range(writers)]
    texts = [await handle.get_result() for handle in handles]
    return {"writers": len(texts)}


@DBOS.workflow()
async def planner(leads: int, writers: int) -> dict[str, Any]:
    """The planner: its leads as child workflows, then one call."""
    handles = [await DBOS.start_workflow_async(lead, i, writers) for i in range(leads)]
    done = [await handle.get_result() for handle in handles]
    return {"leads": len(done), "text": await call_model(planner_prompt(len(done)))}


@DBOS.workflow()
async def link(level: int, depth: int) -> str:
    """A chain level: one call, then the next level as a child workflow."""
    text = await call_model(link_prompt(level))
    if level >= depth:
        return text
    child = await DBOS.start_workflow_async(link, level + 1, depth)
    return await child.get_result()


async def setup(stack: AsyncExitStack, db_url: str, chat: Chat, shape: Shape,
                option: str) -> Callable[[bool], Awaitable[Any]]:
    """Launch DBOS (recovering what a crash left); return ``go(resume)``."""
    _chat[:] = [chat]
    DBOS(config={"name": "peers", "system_database_url": db_url})
    DBOS.launch()
    stack.callback(DBOS.destroy)
    root_id = f"root-{shape.kind}"

    async def go(resume: bool) -> Any:
        if resume:  # launch() has recovered it already: wait for its result
            return await (await DBOS.retrieve_workflow_async(root_id)).get_result()
        with SetWorkflowID(root_id):
            handle = (await DBOS.start_workflow_async(planner, shape.leads, shape.writers)
                      if shape.kind == "tree" else
                      await DBOS.start_workflow_async(link, 1, shape.depth))
        return await handle.get_result()

    return go


#: How many writers' answers the system database holds (read after a kill).
DURABLE_ANSWERS = ("SELECT count(*) FROM dbos.operation_outputs o "
                   "JOIN dbos.workflow_status w USING (workflow_uuid) "
                   "WHERE o.function_name LIKE '%call_model' AND w.name LIKE '%writer'")
