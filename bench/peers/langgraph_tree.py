"""The tree and the chain on LangGraph: ``Send`` fan-out and an ``AsyncPostgresSaver``.

The tree: the graph fans out one ``Send`` per lead to a lead subgraph, which fans out one
``Send`` per writer (one model call each) and collects their answers; the graph's
``aggregate`` node makes the planner's call once every lead is back. The chain: one
``link`` node (one model call) looping on itself ``depth`` times. Both are compiled with an
``AsyncPostgresSaver`` on a connection pool, as LangGraph's persistence guide shows;
``durability`` is the run's mode: ``async`` (the default: checkpoints written while the
next step runs), ``sync`` (written before the next step starts) or ``exit``. After a crash
the same thread is invoked again with ``None``: it resumes from its last checkpoint, and
the writes of the tasks that finished within the interrupted step are not redone.
"""

from __future__ import annotations

import operator
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Annotated, Any, TypedDict

from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Durability, Send
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from bench.peers.shape import Chat, Shape, link_prompt, planner_prompt, writer_prompt


class TreeState(TypedDict, total=False):
    """The planner's state: the sizes, one entry per lead back, the summary."""

    leads: int
    writers: int
    done: Annotated[list[int], operator.add]
    text: str


class LeadState(TypedDict, total=False):
    """A lead subgraph's state: its writers' answers."""

    lead: int
    writers: int
    texts: Annotated[list[str], operator.add]
    done: Annotated[list[int], operator.add]


class LeadOutput(TypedDict):
    """What a lead hands back to the planner."""

    done: Annotated[list[int], operator.add]


class WriterInput(TypedDict):
    """What a writer is sent."""

    lead: int
    part: int


class ChainState(TypedDict, total=False):
    """The chain's state: the level reached and the answers."""

    level: int
    depth: int
    texts: Annotated[list[str], operator.add]


def tree_graph(chat: Chat) -> StateGraph[Any]:
    """1 -> leads -> writers: nested ``Send`` fan-out through a lead subgraph."""

    async def writer(state: WriterInput) -> dict[str, Any]:
        return {"texts": [await chat(writer_prompt(state["lead"], state["part"]))]}

    def collect(state: LeadState) -> dict[str, Any]:
        return {"done": [len(state["texts"])]}

    lead = StateGraph(LeadState, output_schema=LeadOutput)
    lead.add_node("writer", writer)
    lead.add_node("collect", collect)
    lead.add_conditional_edges(START, lambda s: [Send("writer", {"lead": s["lead"], "part": j})
                                                 for j in range(s["writers"])], ["writer"])
    lead.add_edge("writer", "collect")
    lead.add_edge("collect", END)

    async def aggregate(state: TreeState) -> dict[str, Any]:
        return {"text": await chat(planner_prompt(len(state["done"])))}

    tree = StateGraph(TreeState)
    tree.add_node("lead", lead.compile())
    tree.add_node("aggregate", aggregate)
    tree.add_conditional_edges(START, lambda s: [Send("lead", {"lead": i, "writers": s["writers"]})
                                                 for i in range(s["leads"])], ["lead"])
    tree.add_edge("lead", "aggregate")
    tree.add_edge("aggregate", END)
    return tree


def chain_graph(chat: Chat) -> StateGraph[Any]:
    """One ``link`` node, looping until the chain is ``depth`` levels long."""

    async def link(state: ChainState) -> dict[str, Any]:
        return {"texts": [await chat(link_prompt(state["level"]))], "level": state["level"] + 1}

    chain = StateGraph(ChainState)
    chain.add_node("link", link)
    chain.add_edge(START, "link")
    chain.add_conditional_edges("link", lambda s: END if s["level"] > s["depth"] else "link")
    return chain


async def setup(stack: AsyncExitStack, db_url: str, chat: Chat, shape: Shape,
                option: str) -> Callable[[bool], Awaitable[Any]]:
    """Open the checkpointer; return ``go(resume)``, which runs (or resumes) the work.

    ``option``: the durability mode (``async``, ``sync`` or ``exit``).
    """
    durability: Durability = option  # type: ignore[assignment]
    pool = await stack.enter_async_context(AsyncConnectionPool(
        db_url, max_size=20, open=False,
        kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row}))
    saver = AsyncPostgresSaver(pool)  # type: ignore[arg-type]
    await saver.setup()
    builder = tree_graph(chat) if shape.kind == "tree" else chain_graph(chat)
    graph = builder.compile(checkpointer=saver)
    config: Any = {"configurable": {"thread_id": shape.kind}, "recursion_limit": shape.depth + 10}
    start: dict[str, int] = ({"leads": shape.leads, "writers": shape.writers}
                             if shape.kind == "tree" else {"level": 1, "depth": shape.depth})

    async def go(resume: bool) -> Any:
        return await graph.ainvoke(None if resume else start, config, durability=durability)

    return go


#: How many writers' answers the checkpointer holds (read after a kill).
DURABLE_ANSWERS = "SELECT count(*) FROM checkpoint_writes WHERE channel = 'texts'"
