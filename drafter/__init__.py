"""drafter: train EAGLE-3 speculative-decoding drafters for any LLM, end to end."""

__version__ = "0.1.0"


class DrafterError(RuntimeError):
    """An error the user can act on: the CLI prints its message without a traceback.
    Messages name the file, line and field (or the step) at fault."""
