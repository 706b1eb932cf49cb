"""Errors raised for bad user input.

Every user-facing check raises one of these *before* anything is allocated or written, with a
message that names the offending field (or path) and says how to fix it.
"""


class ConfigError(ValueError):
  """A config field, CLI flag or path has a bad value. The message names the field and the fix."""


class UnsupportedModelError(ConfigError):
  """A Hugging Face checkpoint whose architecture this framework does not implement."""


class TrainingDivergedError(RuntimeError):
  """The loss became NaN or infinite; the message names the step and what to change."""


class StoreCorruptionError(RuntimeError):
  """Data read back from a store failed its checksum or is missing; names array, layer and file.
  `everyone`: every process of the run raises it at the same step (they agreed on it), so they
  leave together (launch.py), as from a refusal of their shared config."""
  everyone = False


class DiskFullError(RuntimeError):
  """A checkpoint or an NVMe store write ran out of disk; names the directory, bytes and fix."""


class ProcessLostError(RuntimeError):
  """A run of several processes lost one of them (a collective failed); names this process, the
  others, and how to resume."""
