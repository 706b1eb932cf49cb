"""Importing dependencies without the optional packages they pull in at import time.

Two of our dependencies import a large package they only use for something this package never
does, whenever it is installed (measured on the 2-core CPU VM, `python -X importtime`):
  tensorboardX  imports torch (to accept torch tensors in its writer): ~1.4 s and ~180 MB of RSS
  flax.nnx      imports IPython (to pick the colours of its reprs in a notebook): ~0.3 s
Both catch the ImportError of a missing package, so `import_without` makes the package look
missing for the length of the import: a None in sys.modules makes `import name` raise
ImportError. The marks are removed right after, so the process can still import those packages;
a package already loaded (a notebook's IPython, a script's torch) is left alone and the import
runs as usual.
"""

import importlib
import sys


def import_without(module: str, absent: tuple[str, ...]):
  """`importlib.import_module(module)` with the packages in `absent` unimportable while it runs
  (those not loaded already)."""
  blocked = [name for name in absent if name not in sys.modules]
  for name in blocked:
    sys.modules[name] = None
  try:
    return importlib.import_module(module)
  finally:
    for name in blocked:
      if name in sys.modules and sys.modules[name] is None:
        del sys.modules[name]
