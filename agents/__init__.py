"""orgchart's agents: what agent authors write against.

``Completion`` is the reply of ``ctx.llm.complete(...)``, typed by its schema
(``Completion[Plan]``: ``reply.output`` is a ``Plan``); see :mod:`agents.replies`.
"""

from agents.replies import Completion, ToolCall, ToolOutcome

__all__ = ["Completion", "ToolCall", "ToolOutcome"]
