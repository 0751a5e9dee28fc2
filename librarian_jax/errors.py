"""The error a user's mistake raises in any layer: `ConfigError`, one line the CLI prints as it is.

It lives at the bottom so that a low layer (`checkpoint`: a step that cannot be used) raises the CLI's one
line without importing the config schema above it; `config_schema` re-exports it.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad config value; the message starts with the key path (`config.section.key`)."""
