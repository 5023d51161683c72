"""The tool loop: ``ctx.llm.acomplete(prompt, tools=..., max_tool_rounds=N)``.

Ollama's tool calling, run by the model layer for one agent call:

1. The model is asked with the tools listed (``tools`` in the chat request). Each round's
   model call is a durable call like any other (position ``<call>#<round>``), so a
   redelivered task replays the rounds its dead worker already paid for.
2. A reply with ``message.tool_calls`` is a *tool round*: each call's arguments are
   validated against the tool's schema. Bad arguments, an unknown tool or a tool the
   ``allowed_tools`` policy refuses go back to the model as a tool error (never passed
   to a function) and the next round counts as a repair. A call of a tool that
   ``requires_approval`` holds the task (:class:`ToolApprovalNeeded`: it waits in
   ``awaiting_approval`` until ``orgchart approve``; the next delivery replays up to the
   call, now approved, and runs it); in an aggregate it is refused instead.
3. Each valid call runs as a durable step (``runtime.llm.durable_steps``; its id
   ``<call>#<round>.<index>``): recorded before and after, served from the record on a
   redelivery. The calls of one reply that are ``async`` run at once; plain ones run one
   after another in a thread. A tool that raises answers the model with its error.
4. The results go back as ``role: "tool"`` messages and the model is asked again, until
   it answers without tool calls or ``max_tool_rounds`` rounds were run (then
   :class:`ToolRoundLimit`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Protocol

from agents.replies import ToolCall, ToolOutcome
from agents.tools import BadToolArguments, Tool
from runtime.core.canonical import canonical_json_spaced, sha256_hex
from runtime.errors import BadInput, OrgchartError
from runtime.llm.durable_steps import StepResult, TaskSteps
from runtime.llm.reply import Message

#: Rounds of tool calls one ``complete`` may run unless it says otherwise.
DEFAULT_MAX_TOOL_ROUNDS = 8
#: How much of a tool's result (as JSON) is sent back to the model.
MAX_TOOL_RESULT_CHARS = 8000


class ToolRoundLimit(OrgchartError):
    """The model still called tools after ``max_tool_rounds`` rounds (a runaway loop)."""


class ToolApprovalNeeded(OrgchartError):
    """A tool call needs a person's approval: the task is held (``awaiting_approval``).

    The ask is recorded first (``tool_approvals``: the task, phase, call id, tool and its
    arguments' hash); the worker moves the task to ``awaiting_approval`` with
    :attr:`detail` as the hold's event detail (for people: the decision is looked up by
    the ask's fields, not by this text). ``orgchart approve`` approves the ask and makes
    the task pending; the next delivery replays the loop up to this call (recorded model
    calls and steps) and runs it.
    """

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class ToolApprovalDenied(OrgchartError):
    """A person denied a tool call (``orgchart reject``): it never runs."""


def approval_detail(call_id: str, name: str, arguments: Any) -> str:
    """The hold's event detail: names the call and its arguments, for people."""
    shown = json.dumps(arguments, sort_keys=True, default=str)[:300]
    return f"tool call {call_id} ({name}) waits for a person's approval; arguments {shown}"


class RoundReply(Protocol):
    """What one model round returns (a ``Completion``)."""

    text: str
    tool_calls: tuple[ToolCall, ...]


#: Makes one model round: ``(position, round) -> Completion`` (a durable call at
#: ``<position>#<round>``).
AskRound = Callable[[str, "ToolRound"], Awaitable[Any]]


def refused(error: str) -> Callable[..., Any]:
    """A step function that records a refusal without calling any tool."""
    def refuse(**_: Any) -> Any:
        raise BadToolArguments(error)
    return refuse


class ToolLoop:
    """Runs the rounds of one tool-calling ``complete`` for a task."""

    def __init__(self, steps: TaskSteps, tools: Sequence[Tool], position: str,
                 allowed: Callable[[str], str | None] | None = None) -> None:
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tools have repeated names: {sorted(names)}")
        self.steps = steps
        self.tools = {t.name: t for t in tools}
        self.position = position
        self.allowed = allowed
        self.outcomes: list[ToolOutcome] = []
        #: The round's step records still being written (awaited after the next ask).
        self._recording: list[asyncio.Future[None]] = []

    def specs(self) -> list[dict[str, Any]]:
        """The tools as the chat request lists them."""
        return [t.ollama_spec() for t in self.tools.values()]

    async def run(self, conversation: list[Message], ask_round: AskRound,
                  max_rounds: int) -> tuple[Any, int, Decimal]:
        """Ask, run the tool calls, ask again; the final reply, the rounds run, their cost.

        Each round's model call is ``ask_round(<position>#<round>, round)``. A round's
        step records are written while the next model call runs (their round trips
        overlap it) and awaited when it returns: a record refused by fencing raises
        :class:`~runtime.errors.LeaseLost` then, before anything else of the round.
        """
        specs, cost, repair = self.specs(), Decimal(0), False
        try:
            for number in range(max_rounds + 1):
                reply = await ask_round(f"{self.position}#{number}",
                                        ToolRound(list(conversation), specs, number, repair))
                cost += reply.cost_usd
                await self._recorded()
                calls = tuple(reply.tool_calls)
                if not calls:
                    return reply, number, cost
                if number == max_rounds:
                    asked = ", ".join(sorted({c.name for c in calls}))
                    raise ToolRoundLimit(
                        f"the model still called tools ({asked}) after max_tool_rounds="
                        f"{max_rounds} round(s); raise max_tool_rounds or tighten the "
                        "prompt")
                ids = [f"{self.position}#{number}.{j}" for j in range(len(calls))]
                results = await self._round(calls, ids)
                self.outcomes += results  # in the order of the calls, not of their ends
                repair = any(r.error is not None
                             and r.error.startswith(BadToolArguments.__name__)
                             for r in results)
                conversation.append({"role": "assistant", "content": reply.text,
                                     "tool_calls": [c.as_message_part() for c in calls]})
                for call, outcome in zip(calls, results, strict=True):
                    conversation.append({"role": "tool", "tool_name": call.name,
                                         "content": _content(outcome)})
        except BaseException:
            await asyncio.gather(*self._recording, return_exceptions=True)
            raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def _recorded(self) -> None:
        """Wait for the step records in flight; raise the first failure among them."""
        recording, self._recording = self._recording, []
        for failure in await asyncio.gather(*recording, return_exceptions=True):
            if isinstance(failure, BaseException):
                raise failure

    async def _round(self, calls: Sequence[ToolCall], ids: list[str]) -> list[ToolOutcome]:
        """Run one reply's calls: async tools at once, plain ones one after another.

        Calls that need a person's approval are checked first: while one is not approved,
        none of the round's calls runs (:class:`ToolApprovalNeeded`).
        """
        await self._check_approvals(calls, ids)
        if len(calls) == 1:  # the usual reply: no tasks to gather (a loop turn each)
            return [await self._call(calls[0], ids[0])]
        results: list[ToolOutcome | None] = [None] * len(calls)

        async def one(j: int) -> None:
            results[j] = await self._call(calls[j], ids[j])

        async def in_order(indexes: list[int]) -> None:
            for j in indexes:
                await one(j)

        concurrent = [j for j, c in enumerate(calls) if self._is_async(c.name)]
        sequential = [j for j in range(len(calls)) if j not in concurrent]
        await asyncio.gather(in_order(sequential), *(one(j) for j in concurrent))
        return [r for r in results if r is not None]

    async def _check_approvals(self, calls: Sequence[ToolCall], ids: list[str]) -> None:
        """Ask for (or find) a person's decision on each call that requires approval.

        A call refused anyway (bad arguments, not allowed) needs none; an aggregate's is
        refused (it cannot be held). Approved: it runs; denied: the loop ends
        (:class:`ToolApprovalDenied`); asked: the task is held (:class:`ToolApprovalNeeded`)
        once every such call of the round is asked (one approval covers them all).
        """
        waiting: list[str] = []
        for call, call_id in zip(calls, ids, strict=True):
            tool = self.tools.get(call.name)
            if (tool is None or not tool.requires_approval or self.steps.phase != "run"
                    or self._refusal(call, tool) is not None):
                continue
            decision = await self.steps.approval(call_id, tool.name,
                                                 tool.validate(call.arguments))
            if decision == "denied":
                raise ToolApprovalDenied(f"tool call {call_id} ({tool.name}) was denied by a "
                                         "person: not run")
            if decision != "approved":
                waiting.append(approval_detail(call_id, call.name, call.arguments))
        if waiting:
            raise ToolApprovalNeeded("; ".join(waiting))

    def _is_async(self, name: str) -> bool:
        tool = self.tools.get(name)
        return tool is not None and tool.is_async

    async def _call(self, call: ToolCall, call_id: str) -> ToolOutcome:
        tool = self.tools.get(call.name)
        refusal = self._refusal(call, tool)
        if refusal is not None or tool is None:
            step = await self.steps.run(call.name, refused(refusal or ""), (),
                                        {"arguments": call.arguments}, position=call_id,
                                        kind="tool", tool_call_id=call_id, defer_finish=True)
        else:
            kwargs = tool.validate(call.arguments)
            step = await self.steps.run(tool.name, tool.fn, (), kwargs, position=call_id,
                                        kind="tool", tool_call_id=call_id, retry=tool.retry,
                                        cost_usd=tool.cost_usd, defer_finish=True)
        if step.recorded is not None:
            self._recording.append(step.recorded)
        return _outcome(call, call_id, step)

    def _refusal(self, call: ToolCall, tool: Tool | None) -> str | None:
        if tool is None:
            return (f"there is no tool {call.name!r}; the tools are: "
                    f"{', '.join(sorted(self.tools))}")
        if tool.requires_approval and self.steps.phase != "run":
            # A held task restarts in its run phase: an aggregate cannot wait for a person.
            return (f"tool {tool.name!r} requires a person's approval, which can only be "
                    f"asked for in a task's run phase (this is {self.steps.phase}): not run")
        if self.allowed is not None:
            reason = self.allowed(call.name)
            if reason is not None:
                return reason
        try:
            tool.validate(call.arguments)
        except BadToolArguments as exc:
            return (f"the arguments do not fit tool {tool.name!r}'s schema at {exc}; call it "
                    "again with arguments that fit")
        return None


def _outcome(call: ToolCall, call_id: str, step: StepResult) -> ToolOutcome:
    return ToolOutcome(call_id, call.name, call.arguments, step.value, step.error,
                       step.replayed)


def _content(outcome: ToolOutcome) -> str:
    """A tool's answer to the model: its JSON result, or its error."""
    if outcome.error is not None:
        return f"error: {outcome.error}"[:MAX_TOOL_RESULT_CHARS]
    return json.dumps(outcome.result, ensure_ascii=False)[:MAX_TOOL_RESULT_CHARS]


@dataclass(frozen=True)
class ToolRound:
    """One model round of a tool loop: the conversation so far and the tools offered."""

    conversation: list[Message]
    specs: list[dict[str, Any]]
    number: int
    repair: bool = False


def round_note(tools: ToolRound | None) -> str:
    """What a round adds to the stored prompt: the tools, the round, the conversation's hash.

    The stored prompt identifies a request; later rounds differ from the first by the tool
    results in their conversation, hence the hash.
    """
    if tools is None:
        return ""
    names = ", ".join(s["function"]["name"] for s in tools.specs)
    note = f"\n\n[tools] {names}; round {tools.number}"
    if tools.number:
        note += f" sha256:{sha256_hex(canonical_json_spaced(tools.conversation))[:16]}"
    return note


def recorded_tool_calls(recorded: Any) -> tuple[ToolCall, ...]:
    """The tool calls of a recorded reply (``model_calls.tool_calls``)."""
    return tuple(ToolCall(str(c.get("name")), c.get("arguments"), str(c.get("id") or ""))
                 for c in recorded or ())


async def run_with_tools(ask_round: AskRound, steps: TaskSteps, tools: Sequence[Tool],
                         position: str, check: Callable[[str], str | None] | None,
                         first: list[Message], max_rounds: int | None) -> Any:
    """Run the loop for one ``complete(..., tools=...)`` at ``position``.

    ``ask_round(position, round)`` makes one round's model call (a durable call at
    ``<position>#<round>``) and returns its ``Completion``. Returns the final one, its
    cost the sum of every round's, with ``tool_results`` and ``tool_rounds``.
    """
    rounds = DEFAULT_MAX_TOOL_ROUNDS if max_rounds is None else int(max_rounds)
    if rounds < 0:
        raise BadInput(f"max_tool_rounds must not be negative (got {max_rounds})")
    loop = ToolLoop(steps, list(tools), position, check)
    final, used, cost = await loop.run(first, ask_round, rounds)
    return dataclasses.replace(final, cost_usd=cost, position=position,
                               tool_results=tuple(loop.outcomes), tool_rounds=used)
