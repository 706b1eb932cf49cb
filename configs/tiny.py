"""Tiny (~3M params, byte-level): trains on a CPU in minutes. The default config is this model."""

from configs import default


def get_config():
  return default.get_config()
