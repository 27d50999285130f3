"""The one error type of the job <-> coordinator file protocol."""

from __future__ import annotations


class ProtocolError(ValueError):
    """A document, file or setting of the protocol that is refused.

    `field` is the path of the offending value (``memory_limits[1].limit_bytes``), ``$`` for the
    document as a whole, or the file / environment variable name for problems before parsing.
    `reason` says what was wrong and which values are accepted.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason
