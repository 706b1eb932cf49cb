"""Shared test set-up: JAX's persistent compilation cache, and the `shared_data` fixture (the real
text in ../shared/data). Shared helpers live in helpers.py; the paths come from there too.

The cache lives outside the checkout (~/.cache, or $MEGATRAIN_TEST_JAX_CACHE) so that CI runs on a
fresh clone still reuse compiled executables from earlier runs on the same machine.
"""

import pathlib

import jax
import pytest

from helpers import JAX_CACHE_DIR, SHARED_DATA

jax.config.update('jax_compilation_cache_dir', JAX_CACHE_DIR)
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', -1)


@pytest.fixture(scope='session')
def shared_data() -> pathlib.Path:
  assert SHARED_DATA.is_dir(), f'tests need the real text in {SHARED_DATA}'
  return SHARED_DATA
