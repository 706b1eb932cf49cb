"""Process set-up that must happen before the first large allocation: the host allocator.

glibc serves every allocation above its mmap threshold (128 KiB, raised dynamically to at most
32 MiB) with a fresh mmap and hands it back with munmap on free; it also trims the top of its heap
whenever more than M_TRIM_THRESHOLD is free there. A training step allocates and frees buffers of
hundreds of MB (XLA:CPU outputs and temporaries, gradients, tier reads), so every step paid for
page faults and zeroing of memory it had just returned to the kernel (tiny config, remat none:
0.090 s/step with 18.8 s of system time over 400 steps). Allocations from threads other than the
main one go to per-thread arenas, whose heaps are at most 64 MiB: a larger buffer is mmap'd there
whatever the threshold.

allocator = 'tuned' (the default) therefore sets, through mallopt:
  M_ARENA_MAX      1        one arena: large buffers from any thread come from the main heap
  M_MMAP_MAX       0        no mmap'd chunks: large buffers come from the heap (brk), where a
                            freed one is reused by the next allocation instead of re-faulted
  M_TRIM_THRESHOLD unlimited  the heap's free top is kept (its pages stay resident)
Freed memory is then kept by the process and reused, so the resident set would be the high-water
mark of the heap (live bytes at the peak + the holes freed buffers leave between live ones) rather
than the bytes live right now. A streamed run is bounded by host memory, and there that high-water
mark runs away: each update allocates a piece's new weights and Adam state while the old ones are
live, in sizes that vary by piece, and the holes fragment a heap that is never trimmed (1b all on
NVMe, 2 steps: 6.67 GB against 2.45 predicted; 125m on the host tier: 5.67 GB after 2 steps and
still growing). So 'tuned' also runs a watcher thread (`HeapTrimmer`): once the resident set is
over a limit it calls malloc_trim(0), which hands every free page of the heap back to the OS (its
free top and the holes inside it), and the resident set tracks live memory. train.py sets the
limit to the plan's predicted host peak x TRIM_MARGIN = 1.1 for a streamed run (`trim_limit`),
and x RESIDENT_TRIM_MARGIN = 1.2 (at least RESIDENT_TRIM_FLOOR above it) for a resident run;
--eval to its own prediction x 1.1; processes that never configure a run (library use, notebooks
building engines themselves) get no limit. Below the limit nothing is faulted in twice.

Measured (BENCHMARKS.md, "One allocator"): issue 10's 1b command (all on NVMe, 2 steps;
whole-process peak RSS, wall) 2.91-3.12 GB in 4:57-5:19 against 6.67 GB in 4:13 with the heap
never trimmed and 2.80 GB in 6:16 with glibc's mmap threshold pinned at 128 KiB (which faults
every XLA:CPU temporary in again on every call; the threshold cannot be raised past 32 MiB, below
XLA's temporaries); the tiny config streamed from the host tier: 0.464 s/step against 0.519 with
glibc untouched. 'system' leaves glibc as it is.

The package applies the choice when it is imported (megatrain_jax/__init__.py), before JAX or the
data pipeline allocate and before their threads start, so launch.py runs, notebooks and library
use all get it; the environment variable MEGATRAIN_JAX_ALLOCATOR=system opts out from the very
start. train.train_and_evaluate then applies `config.runtime.allocator` (mallopt works at any
time and governs later allocations: 'system' after 'tuned' restores glibc's defaults).
Only glibc has mallopt: elsewhere (musl, macOS, or jemalloc / tcmalloc preloaded with LD_PRELOAD,
which manage their memory their own way) this is a no-op.
"""

import ctypes
import logging
import os
import sys
import threading
import time

from megatrain_jax.errors import ConfigError

ALLOCATORS = ('tuned', 'system')
_RETIRED_ALLOCATORS = ('auto', 'bounded')  # settings of earlier versions, now 'tuned'
ENV = 'MEGATRAIN_JAX_ALLOCATOR'  # read at import, before a config exists

# mallopt parameter numbers (<malloc.h>).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
M_ARENA_MAX = -8

# (parameter, value): 'tuned' and glibc's documented defaults, which 'system' restores after
# 'tuned' was applied (M_ARENA_MAX 0 = glibc's own limit of 8 arenas per core).
_TUNED = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1))  # -1: SIZE_MAX, never trim
_DEFAULTS = ((M_ARENA_MAX, 0), (M_MMAP_MAX, 65536), (M_TRIM_THRESHOLD, 128 * 1024),
             (M_MMAP_THRESHOLD, 128 * 1024))

# A streamed run's heap is trimmed above the plan's predicted host peak x TRIM_MARGIN: a run whose
# prediction is a little low keeps more of the heap's reuse, while its peak RSS stays within the
# planner's +-20% (bench/memory_accuracy.py, BENCHMARKS.md: at 1.25 the 125m host and NVMe runs
# peaked at 1.25x their prediction, and 1.1 + a fixed 0.25 GB put 125m on NVMe at 1.3x).
TRIM_MARGIN = 1.1
# A resident run's heap is trimmed only above the bound the planner promises (+25%, less the
# trimmer's SLACK of freed pages it leaves), and never within RESIDENT_TRIM_FLOOR of its
# prediction: below that the heap keeps its high-water mark for speed (tiny config: 0.50 vs 0.61
# s/step with glibc untouched; its 0.54 GB plan peaked at 0.59-0.91 GB, and a limit at 1.2x
# trimmed it 17 times in 60 steps), above it the holes between a large model's step temporaries
# had put a 152k-vocabulary fine-tune at 1.19-1.80x of its prediction, growing step by step.
RESIDENT_TRIM_MARGIN = 1.2
RESIDENT_TRIM_FLOOR = 0.5e9

_applied = None  # the allocator setting in force: None (glibc untouched) or one of ALLOCATORS


def _glibc():
  """The C library if it is glibc with mallopt and nothing replaced malloc, else None."""
  preloaded = os.environ.get('LD_PRELOAD', '')
  if 'jemalloc' in preloaded or 'tcmalloc' in preloaded:
    return None
  try:
    libc = ctypes.CDLL(None)
    libc.gnu_get_libc_version  # glibc only
    mallopt = libc.mallopt
  except (OSError, AttributeError):
    return None
  mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
  return mallopt


def configure_allocator(allocator: str, trim_above: float | None = None) -> bool:
  """Applies `allocator` ('tuned' or 'system', see module docstring) to this process; returns
  whether mallopt accepted every setting (False where there is no glibc). Idempotent; 'system' on
  a process where 'tuned' was never applied changes nothing. `trim_above`: for 'tuned', the
  resident set in bytes above which its heap is trimmed (None: never)."""
  global _applied
  if allocator not in ALLOCATORS:
    retired = (f" ('{allocator}' was folded into 'tuned' on 2026-12-05: 'tuned' bounds its heap "
               "as 'bounded' did; set runtime.allocator='tuned')"
               if allocator in _RETIRED_ALLOCATORS else '')
    raise ConfigError(f'runtime.allocator: {allocator!r} is not one of {", ".join(ALLOCATORS)}'
                      f'{retired}.')
  TRIMMER.watch(trim_above if allocator == 'tuned' else None)
  if allocator == _applied or (allocator == 'system' and _applied is None):
    return True
  mallopt = _glibc()
  if mallopt is None:
    return False
  # 'system' after 'tuned' restores glibc's documented values (its dynamic mmap threshold then
  # stays off: buffers >= 128 KiB are mmap'd and handed back when freed).
  settings = _DEFAULTS if allocator == 'system' else _TUNED
  ok = all([mallopt(param, value) == 1 for param, value in settings])
  _applied = allocator
  return ok


def physical_memory_bytes() -> int:
  """This machine's RAM (sysconf)."""
  return os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')


def process_rss_bytes(statm_fd: int | None = None) -> int | None:
  """This process's resident memory now (Linux: /proc/self/statm), or None where it cannot be
  read. `statm_fd`: that file kept open (one pread per call instead of open, read and close: the
  trimmer's check)."""
  try:
    if statm_fd is not None:
      return int(os.pread(statm_fd, 128, 0).split()[1]) * _PAGE
    with open('/proc/self/statm') as f:
      return int(f.read().split()[1]) * _PAGE
  except (OSError, ValueError, IndexError):
    return None


_PAGE = os.sysconf('SC_PAGE_SIZE')


class _MallInfo2(ctypes.Structure):
  """glibc's struct mallinfo2 (2.33+): byte counts of the malloc heap."""
  _fields_ = [(name, ctypes.c_size_t) for name in (
      'arena', 'ordblks', 'smblks', 'hblks', 'hblkhd', 'usmblks', 'fsmblks', 'uordblks',
      'fordblks', 'keepcost')]


class HeapTrimmer:
  """A daemon thread that calls malloc_trim(0) when the resident set is over `limit` bytes and,
  since the last trim, has grown by SLACK or SLACK bytes were freed into the heap (mallinfo2's
  free bytes, less the fewest seen since: pages a trim handed back stay counted as free chunks),
  checked every POLL_S. So once over the limit the heap holds about SLACK of freed pages above
  live memory, and below it nothing is trimmed (or faulted in again). Started by the first `watch`;
  `watch(None)` pauses it. Needs glibc 2.33+ (mallinfo2); older glibc gets no thread."""

  POLL_S, SLACK = 0.01, 128 << 20

  def __init__(self):
    self.limit = None
    self.trims = 0  # how many times it trimmed (tests, benchmarks)
    self._thread = None
    self._watching = threading.Event()  # set while there is a limit: the thread sleeps otherwise
    self._lock = threading.Lock()
    if hasattr(os, 'register_at_fork'):  # a forked child has no thread: start one if it asks
      os.register_at_fork(after_in_child=self._forget_thread)

  def _forget_thread(self):
    self._thread = None

  def watch(self, limit: float | None) -> None:
    self.limit = limit
    if limit is None or _glibc() is None or not hasattr(ctypes.CDLL(None), 'mallinfo2'):
      self._watching.clear()
      return
    self._watching.set()
    with self._lock:
      if self._thread is None:
        self._thread = threading.Thread(target=self._run, name='megatrain_jax-heap-trimmer',
                                        daemon=True)
        self._thread.start()

  def _run(self) -> None:
    libc = ctypes.CDLL(None)
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int
    libc.mallinfo2.restype = _MallInfo2
    read_rss = process_rss_bytes  # bound once: a test's monkeypatch never reaches the thread
    try:
      statm = os.open('/proc/self/statm', os.O_RDONLY)
    except OSError:
      return  # no /proc: nothing to watch
    # What the last trim left (resident set, free heap bytes); 0 = trim at the next check.
    rss_left = free_left = 0
    while True:
      self._watching.wait()
      time.sleep(self.POLL_S)
      limit, rss = self.limit, read_rss(statm) or 0
      if limit is None or rss <= limit:
        rss_left = free_left = 0  # back over the limit, the first check trims
        continue
      free = libc.mallinfo2().fordblks
      free_left = min(free_left, free)  # freed chunks reused since: their pages are resident
      if rss - rss_left < self.SLACK and free - free_left < self.SLACK:
        continue
      libc.malloc_trim(0)
      self.trims += 1
      rss_left, free_left = read_rss(statm) or 0, libc.mallinfo2().fordblks


TRIMMER = HeapTrimmer()


def trim_limit(streamed: bool, host_peak_bytes: float | None) -> float | None:
  """Where a run's 'tuned' heap is trimmed: above the plan's predicted host peak x TRIM_MARGIN
  for a streamed run (host memory is its bound); x RESIDENT_TRIM_MARGIN for a resident one, whose
  heap keeps its high-water mark for speed below that (its plan on a CPU backend sits within
  0.87-1.11x of its peak, bench/memory_accuracy.py: a limit at 1.1x would trim the default tiny
  run on every step), and at least RESIDENT_TRIM_FLOOR above it. None without a prediction."""
  if not host_peak_bytes:
    return None
  if streamed:
    return host_peak_bytes * TRIM_MARGIN
  return max(host_peak_bytes * RESIDENT_TRIM_MARGIN, host_peak_bytes + RESIDENT_TRIM_FLOOR)


def configure(config, streamed: bool = False, host_peak_bytes: float | None = None) -> None:
  """Applies `config.runtime.allocator` (a config without a runtime section keeps the setting),
  with the trim limit of `trim_limit`: `host_peak_bytes` is the plan's predicted host peak."""
  runtime = config.get('runtime') if hasattr(config, 'get') else None
  if runtime is not None:
    configure_allocator(runtime.allocator, trim_limit(streamed, host_peak_bytes))


def applied() -> str | None:
  """The allocator setting in force: None when glibc was left untouched."""
  return _applied


# XLA:CPU's multi-output fusion (off in XLA by default): fuses elementwise loops that read the same
# inputs into one loop with several outputs. optim.apply_adamw relies on it to update p, m, v in
# one pass over p, g, m, v (28 B per parameter instead of 40: the host AdamW runs at 1.0x torch's
# fused AdamW with it and 0.53-0.66x without, bench/host_adamw.py). No per-compile option takes it
# (jaxlib 0.10.2 rejects map-valued compile options), so it is process-wide and the package turns
# it on when imported: XLA reads XLA_FLAGS when it creates its first backend. It changes how the
# model's own programs fuse on XLA:CPU too: the tiny config's step runs 1.026x as long with it on
# a 2-core CPU (BENCHMARKS.md, "Multi-output fusion by default"; the 1.46x measured on 2026-12-03,
# which kept it opt-in until then, no longer reproduces), and a GPU's model programs are not
# XLA:CPU's. MEGATRAIN_JAX_XLA_CPU_MOF=0 opts out. Options starting with 'xla_' are not passed on
# to LLVM.
MOF_FLAG = '--xla_backend_extra_options=xla_cpu_use_multi_output_fusion'
MOF_ENV = 'MEGATRAIN_JAX_XLA_CPU_MOF'
_mof_too_late = False  # JAX had created its backends before the package set the flag


def multi_output_fusion() -> bool:
  """Whether XLA:CPU's multi-output fusion is in force in this process: XLA_FLAGS ask for it and
  JAX created its backends after they did."""
  return 'xla_cpu_use_multi_output_fusion' in os.environ.get('XLA_FLAGS', '') and not _mof_too_late


def jax_backends_exist() -> bool:
  """Whether JAX has created its backends already (it reads XLA_FLAGS and its GPU client's
  settings then), without creating them."""
  bridge = sys.modules.get('jax._src.xla_bridge')
  return bool(bridge is not None and getattr(bridge, 'backends_are_initialized', lambda: False)())


def warn_if_gpu_started_first() -> bool:
  """Whether JAX's client, which exists already, is an accelerator's: then XLA took its own memory
  settings, which this process plans with, and it says so, naming the import order as the fix."""
  import jax  # pylint: disable=import-outside-toplevel
  if jax.default_backend() == 'cpu':
    return False
  print('warning: JAX started before megatrain_jax was imported, so XLA runs with its own '
        'defaults: 75% of GPU memory and a 64 GiB cap on pinned host memory (the planner budgets '
        'those). Import megatrain_jax before anything runs on the GPU (in a notebook: restart, '
        'import it first) to plan with 90% and the RAM, or set XLA_PYTHON_CLIENT_MEM_FRACTION '
        'and XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB before starting.', file=sys.stderr, flush=True)
  return True


def configure_from_env() -> None:
  """The import-time defaults: allocator 'tuned' unless MEGATRAIN_JAX_ALLOCATOR says otherwise;
  XLA:CPU multi-output fusion unless MEGATRAIN_JAX_XLA_CPU_MOF=0 or XLA_FLAGS already set backend
  extra options (XLA keeps only the last --xla_backend_extra_options). Where JAX created its
  backends before this import (a notebook that ran JAX first), the flag could no longer take
  effect: it is left unset and the host AdamW compiles for one loop per output."""
  global _mof_too_late
  choice = os.environ.get(ENV, 'tuned')
  configure_allocator(choice if choice in ALLOCATORS else 'tuned')
  flags = os.environ.get('XLA_FLAGS', '')
  if os.environ.get(MOF_ENV, '1') != '0' and 'xla_backend_extra_options' not in flags:
    if jax_backends_exist():
      _mof_too_late = True
      logging.info('JAX was initialized before megatrain_jax was imported: XLA:CPU multi-output '
                   'fusion stays off (import megatrain_jax first for the one-pass host AdamW)')
    else:
      os.environ['XLA_FLAGS'] = f'{flags} {MOF_FLAG}'.strip()
