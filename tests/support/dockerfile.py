"""A small Dockerfile reader for checks that need no Docker engine: stages and instructions."""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass
class Stage:
    """One `FROM base [AS name]` stage and its instructions as (KEYWORD, rest) pairs."""

    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def values(self, keyword: str) -> list[str]:
        """The arguments of every `keyword` instruction of the stage, in order."""
        return [rest for kw, rest in self.instructions if kw == keyword]


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages, with continuation lines joined."""
    joined = re.sub(r"\\\n", " ", text)
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for raw in joined.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            words = rest.split()
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        elif stages:
            stages[-1].instructions.append((keyword, rest.strip()))
        elif keyword == "ARG":
            key, _, default = rest.partition("=")
            args[key.strip()] = default.strip()
    return args, stages
