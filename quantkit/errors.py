"""Errors a user can act on.  The CLI prints them as one line and exits non-zero."""


class QuantkitError(Exception):
    """A problem with the user's input: a file, a recipe, an option."""


class GGUFFormatError(QuantkitError):
    """A GGUF file that is malformed; the message names the file and the byte offset."""

    def __init__(self, path, offset: int | None, msg: str):
        where = f"{path}" if offset is None else f"{path} @ offset {offset}"
        super().__init__(f"{where}: {msg}")
        self.path, self.offset = path, offset
