"""Helpers shared by the ``rlbuffers`` subcommands (:mod:`rlbuffers.cli`,
:mod:`rlbuffers.cli.verify`, ...): they import this module, never each other, so the command
line has no import cycle. Standard library only, so ``--help`` stays fast."""

from __future__ import annotations

import json
from typing import Any


def json_option(text: str | None, option: str) -> Any:
    """The value of a JSON command-line option (None when not given).

    Raises:
        ValueError: ``text`` is not valid JSON (the option and the text are named).
    """
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{option}: expected JSON such as '{{\"key\": \"value\"}}', "
                         f"got {text!r} ({e})") from None
