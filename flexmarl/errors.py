"""Errors a user can act on."""


class ConfigError(ValueError):
  """A config field is wrong; the message names the field, the value and the fix."""
