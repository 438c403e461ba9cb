"""Errors of the tools that name the bad file or flag and the fix in one line."""


class ConversionError(RuntimeError):
    """Bad input for a conversion (the one-line message names the file or flag and the fix)."""
