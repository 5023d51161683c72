"""Policy rules: checks every task's input, output and delegation must pass.

A user rule is a :class:`Policy` subclass in the user's own module, listed in
``[policies] modules``; see ``docs/writing-policies.md``.
"""

from __future__ import annotations

from policies.base import Policy, Violation
from policies.criteria import validate_criteria
from policies.loader import PolicySet, load_policy_set

__all__ = ["Policy", "PolicySet", "Violation", "load_policy_set", "validate_criteria"]
