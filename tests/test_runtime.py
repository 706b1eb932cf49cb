"""runtime.py: the tuned allocator keeps large freed buffers for reuse and trims its heap above a
limit; 'system' leaves glibc be."""

import json
import os
import subprocess
import sys

import pytest

from megatrain_jax import runtime
from megatrain_jax.errors import ConfigError

# Allocates and frees a 64 MiB buffer 8 times, from the main thread and from a worker thread (whose
# allocations would go to a per-thread arena), touching every page; prints minor page faults per
# round. `then` is applied with configure_allocator after the import-time setting, with
# `trim_above` (bytes) as its trim limit.
_PROBE = '''
import json, resource, sys, threading
import numpy as np
from megatrain_jax import runtime
np._core.multiarray._set_madvise_hugepage(False)  # 4 KiB pages: one fault per page touched
if sys.argv[1] != '-':
  runtime.configure_allocator(sys.argv[1], None if sys.argv[2] == '-' else float(sys.argv[2]))
def churn():
  for _ in range(8):
    a = np.ones(16 << 20, np.float32)
    del a
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn()
worker = threading.Thread(target=churn)
worker.start(); worker.join()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({'faults_per_round': faults / 16, 'applied': runtime.applied()}))
'''
PAGES = (64 << 20) // 4096


def _probe(env_allocator: str, then: str = '-', trim_above: float | None = None) -> dict:
  env = dict(os.environ, MEGATRAIN_JAX_ALLOCATOR=env_allocator)
  limit = '-' if trim_above is None else str(trim_above)
  out = subprocess.run([sys.executable, '-c', _PROBE, then, limit], env=env, capture_output=True,
                       text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(runtime._glibc() is None, reason='mallopt is glibc only')
def test_tuned_reuses_freed_buffers_and_system_does_not():
  tuned, system = _probe('tuned'), _probe('system')
  assert tuned['applied'] == 'tuned' and system['applied'] is None  # glibc untouched
  assert system['faults_per_round'] > PAGES / 2  # every round faults its buffer in again
  assert tuned['faults_per_round'] < PAGES / 10  # the first round only, amortised
  restored = _probe('tuned', then='system')  # the config's 'system' after the import default
  assert restored['applied'] == 'system' and restored['faults_per_round'] > PAGES / 2


def test_rejects_unknown_allocator():
  with pytest.raises(ConfigError, match='runtime.allocator') as unknown:
    runtime.configure_allocator('jemalloc')
  assert 'folded' not in str(unknown.value)
  for retired in ('auto', 'bounded'):  # an earlier version's settings name the one they became
    with pytest.raises(ConfigError, match=rf"'{retired}' was folded into 'tuned' on 2026-12-05.*"
                       r"set runtime.allocator='tuned'"):
      runtime.configure_allocator(retired)


def test_configure_reads_the_config_section():
  """A run's trim limit: the plan's host peak x TRIM_MARGIN when it streams, else x
  RESIDENT_TRIM_MARGIN and at least RESIDENT_TRIM_FLOOR above it; none without a plan."""
  from configs import default  # pylint: disable=import-outside-toplevel
  config = default.get_config()
  assert config.runtime.allocator == 'tuned'
  assert runtime.trim_limit(True, 2e9) == pytest.approx(2e9 * runtime.TRIM_MARGIN)
  assert runtime.trim_limit(False, 4e9) == pytest.approx(4e9 * runtime.RESIDENT_TRIM_MARGIN)
  assert runtime.trim_limit(False, 0.5e9) == pytest.approx(0.5e9 + runtime.RESIDENT_TRIM_FLOOR)
  assert runtime.trim_limit(False, None) is None
  try:
    runtime.configure(config, streamed=True, host_peak_bytes=2e9)
    assert runtime.applied() in ('tuned', None)  # None where there is no glibc
    assert runtime.TRIMMER.limit == pytest.approx(2e9 * runtime.TRIM_MARGIN)
  finally:
    runtime.configure_allocator('tuned')  # the import-time setting: no trim limit
  assert runtime.TRIMMER.limit is None


def test_multi_output_fusion_is_on_by_default_with_an_opt_out():
  """The package turns XLA:CPU's multi-output fusion on at import (the one-pass host AdamW),
  unless MEGATRAIN_JAX_XLA_CPU_MOF=0, XLA_FLAGS set their own backend extra options (XLA keeps only
  the last), or JAX created its backends before the import (too late: it claims nothing)."""
  code = ('import os, sys\n'
          'if sys.argv[1] == "late": import jax; jax.devices()\n'
          'import megatrain_jax\n'
          'from megatrain_jax import runtime\n'
          'print(runtime.multi_output_fusion(), os.environ.get("XLA_FLAGS", ""))')
  base = {k: v for k, v in os.environ.items() if k not in ('XLA_FLAGS', runtime.MOF_ENV)}
  run = lambda when='first', **env: subprocess.run(
      [sys.executable, '-c', code, when], capture_output=True, text=True, check=True,
      env={**base, **env}).stdout.strip()
  assert run() == f'True {runtime.MOF_FLAG}'
  assert run(MEGATRAIN_JAX_XLA_CPU_MOF='0') == 'False'
  assert run(XLA_FLAGS='--xla_dump_to=/x') == f'True --xla_dump_to=/x {runtime.MOF_FLAG}'
  assert run(XLA_FLAGS='--xla_backend_extra_options=foo') == (
      'False --xla_backend_extra_options=foo')
  assert run('late') == 'False'


# Fills 1 GiB of heap with 16 MiB buffers, frees all but the last (so glibc cannot give the space
# back by shrinking the heap's top), waits (up to 5 s for the trimmer), and prints the resident set
# before and after the free.
_TRIM_PROBE = '''
import json, sys, time
import numpy as np
from megatrain_jax import runtime
np._core.multiarray._set_madvise_hugepage(False)
limit = runtime.process_rss_bytes() + (256 << 20)  # the trim limit: 256 MiB above the start
runtime.configure_allocator('tuned', limit if sys.argv[1] == 'trim' else None)
buffers = [np.ones(4 << 20, np.float32) for _ in range(64)]  # 64 x 16 MiB, every page touched
full = runtime.process_rss_bytes()
del buffers[:-1]
deadline = time.monotonic() + 5  # the trimmer checks every 10 ms; a loaded machine delays it
while time.monotonic() < deadline and full - runtime.process_rss_bytes() < (768 << 20):
  time.sleep(0.05)
time.sleep(0.2)  # and the heap without a limit, which never trims, gets the same time
print(json.dumps({'full': full, 'after_free': runtime.process_rss_bytes(), 'trims': runtime.TRIMMER.trims}))
'''


@pytest.mark.skipif(runtime._glibc() is None, reason='mallopt is glibc only')
def test_tuned_hands_freed_heap_back_above_its_limit_and_keeps_it_without_one():
  """Once the resident set passes the trim limit (a streamed run's plan peak x TRIM_MARGIN; here
  the start + 256 MiB) the trimmer returns the heap's free pages; without a limit they are kept."""
  def probe(mode):
    out = subprocess.run([sys.executable, '-c', _TRIM_PROBE, mode], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])
  gib = 1 << 30
  kept, trimmed = probe('keep'), probe('trim')
  assert kept['full'] - kept['after_free'] < 0.1 * gib  # no limit: every freed page kept
  assert kept['trims'] == 0
  assert trimmed['trims'] >= 1
  assert trimmed['full'] - trimmed['after_free'] > 0.7 * gib  # ~1 GiB freed, handed back


@pytest.mark.skipif(runtime._glibc() is None, reason='mallopt is glibc only')
def test_tuned_reuses_freed_buffers_below_its_trim_limit():
  """Below its limit the trimmer does nothing: a freed buffer is reused, not faulted in again
  (glibc's mmap threshold pinned at 128 KiB, the earlier 'bounded', faulted every XLA temporary
  in on every call)."""
  below = _probe('tuned', then='tuned', trim_above=runtime.physical_memory_bytes() / 2)
  assert below['applied'] == 'tuned'
  assert below['faults_per_round'] < PAGES / 10
