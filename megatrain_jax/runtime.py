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
Freed memory is then kept by the process and reused, so the resident set is the high-water mark
of the heap (live bytes at the peak + fragmentation) rather than the bytes live right now; the
planner's host-memory budget already counts the peak. 'bounded' sets glibc's documented values
explicitly, which fixes the mmap threshold at 128 KiB (glibc otherwise raises it up to 32 MiB as
buffers are freed, and per-thread arenas then keep them): every large buffer is returned to the OS
when freed, so the resident set tracks live memory (streamed runs, where memory is the bound;
'auto' picks it for them). 'system' leaves glibc as it is.

The package applies the choice when it is imported (megatrain_jax/__init__.py), before JAX or the
data pipeline allocate and before their threads start, so launch.py runs, notebooks and library
use all get it; the environment variable MEGATRAIN_JAX_ALLOCATOR=system opts out from the very
start. train.train_and_evaluate then applies `config.runtime.allocator` (mallopt works at any
time and governs later allocations: 'system' after 'tuned' restores glibc's defaults).
Only glibc has mallopt: elsewhere (musl, macOS, or jemalloc / tcmalloc preloaded with LD_PRELOAD,
which manage their memory their own way) this is a no-op.
"""

import ctypes
import os

from megatrain_jax.errors import ConfigError

ALLOCATORS = ('tuned', 'bounded', 'system')
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

_applied = None  # the allocator setting in force: None (glibc untouched), 'tuned' or 'system'


def _glibc():
  """The C library if it is glibc with mallopt and nothing replaced malloc, else None."""
  if 'jemalloc' in os.environ.get('LD_PRELOAD', '') or 'tcmalloc' in os.environ.get('LD_PRELOAD', ''):
    return None
  try:
    libc = ctypes.CDLL(None)
    libc.gnu_get_libc_version  # glibc only
    mallopt = libc.mallopt
  except (OSError, AttributeError):
    return None
  mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
  return mallopt


def configure_allocator(allocator: str) -> bool:
  """Applies `allocator` ('tuned' or 'system', see module docstring) to this process; returns
  whether mallopt accepted every setting (False where there is no glibc). Idempotent; 'system'
  on a process where 'tuned' was never applied changes nothing."""
  global _applied
  if allocator not in ALLOCATORS:
    raise ConfigError(f'runtime.allocator: {allocator!r} is not one of auto, '
                      f'{", ".join(ALLOCATORS)}.')
  if allocator == _applied or (allocator == 'system' and _applied in (None, 'bounded')):
    return True
  mallopt = _glibc()
  if mallopt is None:
    return False
  # 'bounded' and 'system' after 'tuned' both set glibc's documented values explicitly; setting
  # M_MMAP_THRESHOLD turns off glibc's dynamic threshold, so every buffer >= 128 KiB is mmap'd and
  # handed back when freed (no retained heap: resident memory tracks live memory).
  ok = all([mallopt(param, value) == 1 for param, value in (_TUNED if allocator == 'tuned' else _DEFAULTS)])
  _applied = allocator
  return ok


AUTO = 'auto'  # 'tuned', unless the run keeps state on NVMe (see `resolve`)


def resolve(allocator: str, streamed: bool) -> str:
  """'auto' -> 'bounded' for streamed runs (state on the host or NVMe tier), else 'tuned'. A
  streamed run is bounded by host memory, not by page faults, and 'tuned' lets its heap grow past
  the live bytes: each update allocates a piece's new weights and Adam state while the old ones are
  live, in sizes that vary by piece, and the freed holes fragment a heap that is never trimmed.
  Measured (whole-process peak RSS): the 1b shape cut to 2 layers, all on NVMe, one step: 11.0 GB
  'tuned', 9.0 GB glibc untouched (its dynamic mmap threshold lets freed buffers of up to 32 MiB
  pile up in per-thread arenas), 3.2 GB 'bounded' (same loss); 125m all on the host tier: 5.67 GB
  'tuned' after 2 steps and still growing, 4.10 GB 'bounded' after 4. Resident runs get 'tuned'
  (tiny config: 0.50 vs 0.61 s/step)."""
  if allocator == AUTO:
    return 'bounded' if streamed else 'tuned'
  return allocator


def _runtime_section(config):
  """`config.runtime`, or None for a config without that section."""
  return config.get('runtime') if hasattr(config, 'get') else None


def configure(config, streamed: bool = False) -> None:
  """Applies `config.runtime.allocator` ('auto' resolved by `streamed`; a config without a
  runtime section keeps the setting)."""
  runtime = _runtime_section(config)
  if runtime is not None:
    if runtime.allocator not in ALLOCATORS + (AUTO,):
      configure_allocator(runtime.allocator)  # raises the ConfigError naming the choices
    configure_allocator(resolve(runtime.allocator, streamed))


def streamed_tuned_warning(config, streamed: bool) -> str | None:
  """The console line for a streamed run whose `config.runtime.allocator` asks for 'tuned' by
  name: its peak RSS is the heap's high-water mark, which the planner's predicted_host_peak_gb
  does not bound (`resolve`). None otherwise."""
  runtime = _runtime_section(config)
  if runtime is None or runtime.allocator != 'tuned' or not streamed:
    return None
  return ("warning: runtime.allocator='tuned' on a streamed run keeps every freed buffer in the "
          'heap, so peak RSS can exceed the plan several-fold (1b, all on NVMe: 6.67 GB against '
          "2.45 predicted); 'auto' (the default) gives streamed runs 'bounded'.")


def applied() -> str | None:
  """The allocator setting in force: None when glibc was left untouched."""
  return _applied


# XLA:CPU's multi-output fusion (off in XLA by default): fuses elementwise loops that read the same
# inputs into one loop with several outputs. optim.apply_adamw relies on it to update p, m, v in
# one pass (bench/host_adamw.py). It is process-wide (no per-compile option takes it) and it also
# stops XLA:CPU from duplicating cheap producers into their consumers, which made the tiny model's
# step 1.46x slower on a 2-core CPU: so it is opt-in, MEGATRAIN_JAX_XLA_CPU_MOF=1, set at import
# (XLA reads XLA_FLAGS when it creates its first backend). Options starting with 'xla_' are not
# passed on to LLVM, and GPU compilers ignore this one.
MOF_FLAG = '--xla_backend_extra_options=xla_cpu_use_multi_output_fusion'
MOF_ENV = 'MEGATRAIN_JAX_XLA_CPU_MOF'


def multi_output_fusion() -> bool:
  """Whether XLA_FLAGS turn on XLA:CPU's multi-output fusion (the package sets it at import)."""
  return 'xla_cpu_use_multi_output_fusion' in os.environ.get('XLA_FLAGS', '')


def configure_from_env() -> None:
  """The import-time defaults: allocator 'tuned' unless MEGATRAIN_JAX_ALLOCATOR says otherwise;
  XLA:CPU multi-output fusion with MEGATRAIN_JAX_XLA_CPU_MOF=1 unless XLA_FLAGS already set
  backend extra options (XLA keeps only the last --xla_backend_extra_options)."""
  choice = os.environ.get(ENV, 'tuned')
  configure_allocator(choice if choice in ALLOCATORS else 'tuned')
  flags = os.environ.get('XLA_FLAGS', '')
  if os.environ.get(MOF_ENV, '0') == '1' and 'xla_backend_extra_options' not in flags:
    os.environ['XLA_FLAGS'] = f'{flags} {MOF_FLAG}'.strip()
