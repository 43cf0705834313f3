"""The root of blockagg's error hierarchy.

Every error blockagg raises on purpose derives from :class:`BlockaggError`, so a
caller can tell "blockagg refused, with a reason" from a bug. Each subpackage keeps
its own small ``exceptions.py`` with subclasses; messages say what happened, carry
the offending value, and say what to change.
"""


class BlockaggError(Exception):
    """Base class of every error blockagg raises deliberately."""


class ConfigError(BlockaggError):
    """A setting is unknown, malformed, or contradicts another one."""
