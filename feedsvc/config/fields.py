"""How a setting is declared: a dataclass field whose metadata carries its
help text, its ``serve --help`` section and its bounds, so the flag, its
``FEEDSVC_*`` variable and its check come from one place. Every section of
:class:`feedsvc.config.Settings` declares its fields with :func:`opt`.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

# The section of ``serve --help`` that the settings declared next belong to:
# each section's class body calls section() before its fields, and opt() files
# each field under the latest one, so a new setting takes its neighbours'.
_current_section = ["options"]


def section(title: str) -> None:
    _current_section[0] = title


def opt(default: Any, help: str, **extra: Any) -> Any:
    metadata = {"help": help, "section": _current_section[0], **extra}
    return field(default=default, metadata=metadata)
