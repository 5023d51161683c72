"""ChildSpec names its child's agent by class or by name; it keeps the name."""

from __future__ import annotations

import dataclasses

from agents.base import Agent, ChildSpec


class Poet(Agent):
    name = "spec_test_poet"
    register = False


def test_a_class_or_its_name_make_the_same_spec() -> None:
    by_class = ChildSpec(agent=Poet, payload={"mood": "calm"}, key="calm", priority=3)
    by_name = ChildSpec("spec_test_poet", {"mood": "calm"}, "calm", priority=3)
    assert by_class == by_name and by_class.agent == "spec_test_poet"
    assert dataclasses.replace(by_class, key="sad").agent == "spec_test_poet"
