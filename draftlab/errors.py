"""Errors meant for the user: the stage prints the message (no traceback) and exits non-zero."""


class UserError(Exception):
    """Bad input or configuration; the message names the file/key/row and what to do."""
