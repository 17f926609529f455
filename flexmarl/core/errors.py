"""Errors shared by modules that must not import one another."""


class ConfigError(ValueError):
  """A bad config field: the message names the field, its value and the fix."""


class CheckpointFileError(ValueError):
  """A model file that cannot be used. `problem` says what is wrong and the fix without
  naming the file, so a caller can name the config field that gave it instead."""

  def __init__(self, checkpoint: str, problem: str):
    super().__init__(checkpoint, problem)  # both args: it pickles (Ray ships errors)
    self.checkpoint, self.problem = checkpoint, problem

  def __str__(self) -> str:
    return f'model.checkpoint={self.checkpoint!r}: {self.problem}'
