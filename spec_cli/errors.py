class SpecError(Exception):
    """An error the user can act on: the CLI prints its message as one line, without a traceback."""


class OutOfMemory(SpecError):
    """The device ran out of memory: a server answers 503 with the message and keeps serving."""
