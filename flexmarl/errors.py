"""Errors shared by modules that must not import one another."""


class ConfigError(ValueError):
  """A bad config field: the message names the field, its value and the fix."""
