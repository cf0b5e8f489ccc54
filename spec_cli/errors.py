class SpecError(Exception):
    """An error the user can act on: the CLI prints its message as one line, without a traceback."""
