"""A trace of a few training steps (`profile.start_step`, `profile.steps`) with jax.profiler.

What a slow step spends its time on is a question the step time cannot answer: on a GPU the
streamed engine's weight fetches (host -> device copies), its compute and its write-backs run on
different streams and should overlap; the host runs the data pipeline, the dispatches and, with
offload.optimizer_on = host, the AdamW. A trace shows each of them on a timeline: XLA's ops (by
the names of the jitted functions: the group forward, the group backward, the update), the
copies between memory kinds, and the host threads, for the steps asked. Each step is one
`StepTraceAnnotation` ('train', step_num), so the viewers group the timeline by step.

The trace goes to <workdir>/profile/plugins/profile/<time>/ (each process of a multi-process run
writes its own files): <host>.xplane.pb for TensorBoard's Profile tab (`pip install
tensorboard-plugin-profile; tensorboard --logdir <workdir>/profile`) and <host>.trace.json.gz,
which Perfetto (ui.perfetto.dev) opens as it is. Tracing adds its own overhead, and the first
step of a process includes compilation: trace later steps (start_step 3 or more) for timings.
"""

import collections
import contextlib
import pathlib

import jax


class StepProfiler:
  """Starts a trace before step `start_step` and stops it after step `start_step + steps - 1`
  (or when the run ends first); `start_step` 0 = off. Use `with profiler.step(n): ...` around
  each training step, and close() (or a `with` block) at the end."""

  def __init__(self, start_step: int, steps: int, workdir: pathlib.Path, say=print):
    self.first, self.last = start_step, start_step + steps - 1
    self.directory = pathlib.Path(workdir) / 'profile'
    self._say = say
    self._tracing, self._done, self._traced = False, False, []

  def __enter__(self) -> 'StepProfiler':
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  @contextlib.contextmanager
  def step(self, step: int):
    """The training step `step` (the step that makes `step` steps done), traced when it is one of
    the profiled steps (a run resumed inside them traces the rest)."""
    if self.first and self.first <= step <= self.last and not self._tracing and not self._done:
      self.directory.mkdir(parents=True, exist_ok=True)
      jax.profiler.start_trace(str(self.directory))
      self._tracing = True
    if not self._tracing:
      yield
      return
    with jax.profiler.StepTraceAnnotation('train', step_num=step):
      yield
    self._traced.append(step)
    if step >= self.last:
      self.close()

  def close(self) -> None:
    """Stops the trace (if one runs) and says where it is."""
    if not self._tracing:
      return
    self._tracing, self._done = False, True
    jax.profiler.stop_trace()
    steps = (f'{self._traced[0]}-{self._traced[-1]}' if self._traced else 'none')
    self._say(f'profile: steps {steps} traced into {self.directory} '
              f'(tensorboard --logdir {self.directory}, Profile tab; docs/outputs.md)')


@contextlib.contextmanager
def programs_executed():
  """Counts every XLA program run inside the block, by name (a Counter of e.g. 'group_forward',
  'convert_element_type'): the engines' jitted stage functions, eager jax operations and
  jax.numpy's own jitted helpers alike, which a trace shows only with its overhead.

  JAX's C++ dispatch fast path runs a cached executable without entering Python, so it is off
  inside the block and its caches are emptied on entry and exit: every call goes through
  pxla.ExecuteReplicated, where it is counted. The compiled executables stay in JAX's Python
  caches (nothing compiles again), but dispatch is slower: for counts (tests,
  bench/dispatch_overhead.py), not timings. Relies on JAX internals of the pinned version."""
  # pylint: disable=import-outside-toplevel,protected-access
  from jax._src import pjit
  from jax._src.interpreters import pxla
  from jax._src.lib import _jax

  counts = collections.Counter()
  call, fastpath = pxla.ExecuteReplicated.__call__, pjit._get_fastpath_data

  def counted(self, *args):
    counts[self.name.removeprefix('jit(').removesuffix(')')] += 1
    return call(self, *args)

  def clear():
    pjit._cpp_pjit_cache_fun_only.clear()
    pjit._cpp_pjit_cache_explicit_attributes.clear()
    _jax.PjitFunctionCache.clear_all()

  pxla.ExecuteReplicated.__call__, pjit._get_fastpath_data = counted, lambda *a, **k: None
  clear()
  try:
    yield counts
  finally:
    pxla.ExecuteReplicated.__call__, pjit._get_fastpath_data = call, fastpath
    clear()
