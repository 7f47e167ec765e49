"""Loading a user's own copy of a published implementation (`--published [NAME=]PATH`).

cafin never ships published code: the bench imports the file from the path the user gives, under a
private module name, and times it beside cafin's variants in the same run.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

from .members import Member


class PublishedError(ValueError):
    """A --published argument that cannot be used; the message names it."""


def parse(values: list[str] | None, members: dict[str, Member]) -> dict[str, str]:
    """{member name: path} from `PATH` (AdaFisher's file) or `NAME=PATH` arguments."""
    out: dict[str, str] = {}
    for value in values or []:
        name, sep, path = value.partition("=")
        if not (sep and name.strip().lower() in members):
            name, path = "adafisher", value
        name = name.strip().lower()
        member = members.get(name)
        if member is None or member.published is None:
            have = [m.name for m in members.values() if m.published is not None]
            raise PublishedError(f"--published {value}: {name!r} takes no published code "
                                 f"(members that do: {', '.join(have) or 'none'})")
        if name in out:
            raise PublishedError(f"--published given twice for {name}")
        out[name] = path
    return out


def load(name: str, path: str, member: Member) -> ModuleType:
    """Import the file at `path` as a private module and check that it defines the member's
    published class."""
    if not os.path.isfile(path):
        raise PublishedError(f"--published {path}: no such file (expected your copy of the "
                             f"published {member.published_file or 'code'})")
    module_name = f"_cafin_bench_published_{name}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise PublishedError(f"--published {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look a module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise PublishedError(f"--published {path}: importing it raised "
                             f"{type(exc).__name__}: {exc}") from exc
    if member.published_class and not hasattr(module, member.published_class):
        raise PublishedError(f"--published {path}: the file defines no class "
                             f"{member.published_class!r} (expected the published "
                             f"{member.published_file or 'code'})")
    return module
