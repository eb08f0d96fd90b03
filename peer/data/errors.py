"""The one exception every user-facing data problem raises.

A subclass of ``ValueError`` so callers that already catch bad values (the CLI turns them into a
one-line message) keep working; its text always names the file or the numbers at fault.
"""

from __future__ import annotations


class DataError(ValueError):
    """Missing or malformed data, a tokenizer that does not fit the model, a bad cursor."""
