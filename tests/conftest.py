"""Shared test set-up: JAX's persistent compilation cache, the `shared_data` fixture (the real
text in ../shared/data), and the machine lock that lets a `timing` test run alone. Shared helpers
live in helpers.py; the paths come from there too.

The cache lives outside the checkout (~/.cache, or $MEGATRAIN_TEST_JAX_CACHE) so that CI runs on a
fresh clone still reuse compiled executables from earlier runs on the same machine.
"""

import fcntl
import os
import pathlib
import tempfile

import jax
import pytest

from helpers import JAX_CACHE_DIR, SHARED_DATA

jax.config.update('jax_compilation_cache_dir', JAX_CACHE_DIR)
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', -1)

# One lock file per test run: the xdist workers of one run share it, other runs do not.
_MACHINE_LOCK = pathlib.Path(tempfile.gettempdir()) / (
    f"megatrain-tests-{os.environ.get('PYTEST_XDIST_TESTRUNUID', os.getpid())}.lock")


@pytest.fixture(scope='session')
def shared_data() -> pathlib.Path:
  assert SHARED_DATA.is_dir(), f'tests need the real text in {SHARED_DATA}'
  return SHARED_DATA


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """Every test holds the machine lock shared; a test marked `timing` holds it alone.

  The suite runs two test files at a time (pytest-xdist). A test that compares a wall-clock time
  with a bound (a dry run's seconds, a predicted step time against the calibrated machine) says
  nothing when the other worker shares the two cores, so it waits for the other worker's current
  test to end, and the other worker waits for it. The lock spans the whole protocol (set-up,
  call, tear-down) so that a module fixture's work counts as its first test's.
  """
  exclusive = item.get_closest_marker('timing') is not None
  with open(_MACHINE_LOCK, 'a+') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    try:
      yield
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


# The test files that take longest (about a minute or more each on 2 cores), longest first. With
# `-n 2 --dist loadfile` xdist hands out whole files in collection order, one to each free worker:
# starting with the long ones leaves short files for the end, so both workers finish together
# instead of one running a long file alone at the end.
LONGEST_FIRST = ('test_preemption.py', 'test_reliability.py', 'test_distributed.py',
                 'test_notebooks.py', 'test_streamed.py', 'test_checkpoint.py',
                 'test_hf_finetune.py', 'test_planner.py', 'test_train.py',
                 'test_vocab_streaming.py', 'test_nvme.py')


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order within a file
