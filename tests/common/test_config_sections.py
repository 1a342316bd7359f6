"""common.config_sections: documented fields (``f``) and sections (``sub``); each config owns its mutable
defaults and its sections."""

from __future__ import annotations

import dataclasses
import typing

from common.config_sections import Config, TaskConfig, f, sub


def test_each_config_gets_its_own_lists_dicts_and_sections() -> None:
    a, b = Config(), Config()
    a.metrics.trackers.append("wandb")
    a.task.reward_by_source["x"] = "boxed"
    a.actors.group_size = 3
    assert b.metrics.trackers == [] and b.task.reward_by_source == {} and b.actors.group_size == 8
    assert a.task is not b.task


def test_a_field_carries_its_doc_and_its_default() -> None:
    @dataclasses.dataclass
    class Probe:
        n: int = f(3, "how many")
        names: list[str] = f(["a"], "which")
        task: TaskConfig = sub(TaskConfig, "a nested section")

    fields = {fl.name: fl for fl in dataclasses.fields(Probe)}
    assert {k: fl.metadata["doc"] for k, fl in fields.items()} == {"n": "how many", "names": "which",
                                                                   "task": "a nested section"}
    one, two = Probe(), Probe()
    assert one.n == 3 and one.names == ["a"] and isinstance(one.task, TaskConfig)
    assert one.names is not two.names  # a copy of the default list per instance


def test_every_field_of_the_tree_is_documented() -> None:
    def walk(cls: type, prefix: str) -> list[str]:
        out, hints = [], typing.get_type_hints(cls)  # the annotations are strings (postponed evaluation)
        for fl in dataclasses.fields(cls):
            if not fl.metadata.get("doc"):
                out.append(prefix + fl.name)
            tp = hints[fl.name]
            if isinstance(tp, type) and dataclasses.is_dataclass(tp):
                seen.append(prefix + fl.name)
                out += walk(tp, f"{prefix}{fl.name}.")
        return out

    seen: list[str] = []
    assert walk(Config, "") == []
    assert {"task", "engine", "placement"} <= set(seen)  # the sections were walked into
