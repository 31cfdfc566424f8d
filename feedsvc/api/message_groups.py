"""A posted message's ``"group"``: checked here, its limits in one place.

Ordered message groups are a feedsvc extension (docs/consumers.md#ordered-groups):
messages of one group are handed out (claim, pop) in post order, and at most
one claim at a time holds messages of a group. A group is a string of
1 to :data:`MAX_GROUP_LENGTH` characters, each printable ASCII without the
space (``!`` to ``~``, as SQS's MessageGroupId): it rides on the record's
author line after a space (storage/record.py), so it holds no space or
control character, and it names a key of its own (``Q:g:<group>``).
"""

from __future__ import annotations

import re
from typing import Any, Final

from feedsvc.errors import BadRequest

MAX_GROUP_LENGTH: Final = 128
#: printable ASCII but the space, 1 to MAX_GROUP_LENGTH characters
GROUP_PATTERN: Final = rf"[\x21-\x7e]{{1,{MAX_GROUP_LENGTH}}}"
_GROUP: Final = re.compile(GROUP_PATTERN)


def message_group(value: Any) -> str:
    """The group of one posted message; BadRequest if it breaks the rule above."""
    if not isinstance(value, str) or _GROUP.fullmatch(value) is None:
        raise BadRequest(
            f'A message\'s "group" must be a string of 1 to {MAX_GROUP_LENGTH} printable '
            "ASCII characters other than the space (! to ~)."
        )
    return value
