"""drafter: train EAGLE-3 speculative-decoding drafters for any LLM, end to end."""

__version__ = "0.1.0"


class DrafterError(RuntimeError):
    """An error the user can act on: the CLI prints its message without a traceback.
    Messages name the file, line and field (or the step) at fault."""


def not_utf8(blob: bytes, e: UnicodeDecodeError) -> tuple[int, str]:
    """Where a UTF-8 decode of `blob` failed, for error messages: (line, 'not UTF-8: byte 0x..
    at column N'), line and column 1-based."""
    line = blob.count(b"\n", 0, e.start) + 1
    col = e.start - blob.rfind(b"\n", 0, e.start)
    return line, f"not UTF-8: byte 0x{blob[e.start]:02x} at column {col}"
