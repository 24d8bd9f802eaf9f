"""The one exception type for user mistakes (bad path, bad flag, unsupported config, ...)."""


class MiniCPMError(Exception):
    """A user-facing error: the message says what is wrong and how to fix it.

    The CLI prints these as one line without a traceback; anything else is a bug.
    """
