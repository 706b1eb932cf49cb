"""Metrics: namespaced scalars to `<workdir>/metrics.jsonl` and TensorBoard, a console line, a bar.

Names are namespaced by what they measure: `learning/*` (loss, grad_norm, lr), `eval/*` (loss,
perplexity), `perf/*` (step time, tokens/s, TFLOP/s, MFU) and, in streamed engines, `io/*`.
One JSON object per logged step: `{"step": 10, "learning/loss": 2.31, ...}`.

MFU (`perf/mfu`) is written only against a datasheet peak (a known accelerator): a hardware
profile's measured layer rate (the CPU, calibrated profiles of unknown devices) is no peak, and a
run that beats it would read as "mfu 100.4%".
"""

import dataclasses
import itertools
import json
import math
import pathlib
import resource
import socket
import struct
import sys
import time

import tqdm

from megatrain_jax import fs
from megatrain_jax import runtime
from megatrain_jax.errors import TrainingDivergedError
from megatrain_jax.imports import import_without


# Without torch, which tensorboardX imports whenever installed (megatrain_jax/imports.py).
tensorboardX = import_without('tensorboardX', absent=('torch',))


def due(step: int, every: int, last: int) -> bool:
  """Whether something done every `every` steps (never when 0) is done at `step`: it always is at
  the `last` step."""
  return bool(every and step % every == 0) or step == last


def format_console_line(step: int, total: int, scalars: dict, eta_s: float | None = None) -> str:
  """e.g. 'step 120/600 | loss 2.3456 | grad_norm 0.812 | lr 2.99e-03 | epoch 0.41 | 12,345 tok/s |
  0.166 s/step | eta 01:20' (`eta_s`: seconds to the last step, when known)."""
  parts = [f'step {step}/{total}']
  if 'learning/loss' in scalars:
    parts.append(f'loss {scalars["learning/loss"]:.4f}')
  if 'learning/grad_norm' in scalars:
    parts.append(f'grad_norm {scalars["learning/grad_norm"]:.3f}')
  if 'learning/lr' in scalars:
    parts.append(f'lr {scalars["learning/lr"]:.2e}')
  if 'data/epoch' in scalars:
    parts.append(f'epoch {scalars["data/epoch"]:.2f}')
  if 'eval/loss' in scalars:
    parts.append(f'eval_loss {scalars["eval/loss"]:.4f} | '
                 f'eval_ppl {scalars["eval/perplexity"]:.2f}')
  if 'perf/tokens_per_sec' in scalars:
    parts.append(f'{scalars["perf/tokens_per_sec"]:,.0f} tok/s')
  if 'perf/step_time_s' in scalars:
    parts.append(f'{scalars["perf/step_time_s"]:.3f} s/step')
  if 'perf/mfu' in scalars:
    parts.append(f'mfu {100 * scalars["perf/mfu"]:.1f}%')
  if eta_s is not None:
    parts.append(f'eta {tqdm.tqdm.format_interval(eta_s)}')
  return ' | '.join(parts)


def bar_visible(enabled: bool, stream=None) -> bool:
  """Whether a progress bar that is `enabled` is drawn on `stream` (stderr): on a terminal or in a
  Jupyter kernel, where each redraw replaces the line. Not into a file or a pipe (a SLURM job's
  output, `| tee run.log`), where every redraw appends a `\\r`-joined copy of the bar and the
  console line every `train.log_every` steps, with its ETA, already says how far the run is."""
  stream = stream or sys.stderr
  isatty = getattr(stream, 'isatty', None)
  return enabled and (bool(isatty and isatty()) or 'ipykernel' in sys.modules)


# How often a progress bar writes a line into a log file or pipe (where it cannot redraw).
LOG_LINE_S = 30.0


class _Lines:
  """A file for tqdm that turns each redraw into a line of its own (a log file or a pipe)."""

  def __init__(self, stream):
    self.stream = stream

  def write(self, text: str) -> None:
    text = text.replace('\r', '').rstrip()
    if text:
      self.stream.write(text + '\n')

  def flush(self) -> None:
    self.stream.flush()


def progress_bar(total: int, enabled: bool = True, **kwargs) -> tqdm.tqdm:
  """A tqdm bar on stderr for work with no console line of its own (`--eval`'s windows): redrawn
  in place on a terminal or in a notebook; into a log file or a pipe, one line every LOG_LINE_S
  seconds and at the end, so that a long job's log still says how far it is."""
  if not enabled:
    return tqdm.tqdm(total=total, disable=True)
  if bar_visible(True):
    return tqdm.tqdm(total=total, dynamic_ncols=True, **kwargs)
  return tqdm.tqdm(total=total, file=_Lines(sys.stderr), mininterval=LOG_LINE_S, ncols=100,
                   **kwargs)


def describe_workdir(workdir: pathlib.Path, *, checkpoint_every: int, checkpoint_keep: int,
                     checkpoint_minutes: float, data_dir: str, nvme_dir: str | None,
                     checkpoint_best: bool = False) -> str:
  """A run's first console lines: its workdir and what goes there (docs/outputs.md describes
  each). `data_dir`: data.cache_dir ('' = <workdir>/data); `nvme_dir`: an NVMe tier's
  offload.dir."""
  workdir = pathlib.Path(workdir)

  def where(directory: str) -> str:  # relative to the workdir when inside it
    path = pathlib.Path(directory).expanduser().absolute()
    return f'{path.relative_to(workdir)}/' if path.is_relative_to(workdir) else f'{path}/'

  if checkpoint_every < 0:
    checkpoints = 'no checkpoints (checkpoint.every=-1)'
  else:
    when = f'every {checkpoint_every} steps and at the end' if checkpoint_every else 'at the end'
    if checkpoint_minutes:
      when += f', every {checkpoint_minutes:g} min'
    best = ' and the best eval/loss' if checkpoint_best else ''
    checkpoints = f'checkpoints/ ({when}, newest {checkpoint_keep}{best} kept)'
  parts = ['metrics.jsonl and tensorboard/ (a row per logged step)', checkpoints, 'config.json',
           f'{where(data_dir) if data_dir else "data/"} (tokenized data)']
  if nvme_dir:
    parts.append(f'{where(nvme_dir)} (NVMe tier)')
  resume = 'rerun the same command to resume; ' if checkpoint_every >= 0 else ''
  return f'workdir: {workdir} ({resume}docs/outputs.md)\n  {", ".join(parts)}'


def nothing_to_do(step: int, total: int, field: str = 'train.steps') -> str:
  """What a rerun of a finished run prints instead of a full progress bar; `field` sets its length
  (train.steps, or train.epochs, which counts them)."""
  if step == total:
    return f'nothing to do: step {step} of {total}; raise --config.{field} to continue'
  above = f' above {step}' if field == 'train.steps' else ''
  return (f'nothing to do: step {step} of {total} (the newest checkpoint is past train.steps); '
          f'raise --config.{field}{above} to continue')


@dataclasses.dataclass
class EarlyStopping:
  """train.early_stopping_patience, as Hugging Face's EarlyStoppingCallback: the run stops once
  eval/loss has not improved on its best by more than `threshold` for `patience` evaluations in
  a row (0 = never). Its state (`state`) goes into each checkpoint, so a resumed run counts on
  from where the checkpoint was; `stopped` marks the run that ended early."""
  patience: int
  threshold: float
  best: float | None = None
  best_step: int = 0
  evals_since_best: int = 0
  stopped: bool = False

  @classmethod
  def resumed(cls, patience: int, threshold: float, state: dict | None) -> 'EarlyStopping':
    """A tracker of the config's patience and threshold, counting on from a checkpoint's state."""
    return cls(patience, threshold, **(state or {}))

  def update(self, step: int, eval_loss: float, last: bool = False) -> bool:
    """Counts an evaluation of `step`; True when the run should stop there (it then is
    `stopped`), which it never is at its `last` step: that run ends as it would have."""
    if self.best is None or eval_loss < self.best - self.threshold:
      self.best, self.best_step, self.evals_since_best = eval_loss, step, 0
    else:
      self.evals_since_best += 1
    self.stopped = not last and 0 < self.patience <= self.evals_since_best
    return self.stopped

  def state(self) -> dict:
    return {'best': self.best, 'best_step': self.best_step,
            'evals_since_best': self.evals_since_best, 'stopped': self.stopped}

  def message(self, step: int) -> str:
    return (f'early stop at step {step}: eval/loss has not improved on {self.best:.4f} (step '
            f'{self.best_step}) by more than train.early_stopping_threshold='
            f'{self.threshold:g} for {self.evals_since_best} evaluations '
            f'(train.early_stopping_patience={self.patience})')


class EventFile:
  """TensorBoard's event file of one attempt (`<directory>/events.out.tfevents.<time>.<host>`,
  tensorboardX's name and records), written and flushed in the caller's thread. Not
  tensorboardX's SummaryWriter: it writes from a thread of its own and flushes again at exit
  (atexit), so a disk that filled during a run printed their two tracebacks after the run's one
  error line, and a write that failed in that thread went unseen.

  The attempt's first events mark `purge_step`: TensorBoard's reader hides the events of earlier
  files from that step on (a SessionLog START there), which a resumed run redoes."""

  def __init__(self, directory: pathlib.Path, purge_step: int):
    directory.mkdir(parents=True, exist_ok=True)
    name = f'events.out.tfevents.{int(time.time())}.{socket.gethostname()}'
    self.path = directory / name
    for attempt in itertools.count(1):  # an attempt started in the same second keeps its file
      try:
        self._file = open(self.path, 'xb')
        break
      except FileExistsError:
        self.path = directory / f'{name}.{attempt}'
    event_pb2 = tensorboardX.proto.event_pb2
    with fs.naming(self.path):
      self._add(event_pb2.Event(wall_time=time.time(), step=purge_step,
                                file_version='brain.Event:2'))
      self._add(event_pb2.Event(wall_time=time.time(), step=purge_step, session_log=(
          event_pb2.SessionLog(status=event_pb2.SessionLog.START))))
      self._file.flush()

  def write(self, step: int, scalars: dict) -> None:
    """A row of scalars at `step`, flushed (as far on disk as metrics.jsonl)."""
    with fs.naming(self.path):  # a full disk: say where
      for name, value in scalars.items():
        self._add(tensorboardX.proto.event_pb2.Event(
            wall_time=time.time(), step=step, summary=tensorboardX.summary.scalar(name, value)))
      self._file.flush()

  def _add(self, event) -> None:
    """One TFRecord: length, its masked CRC-32C, the event, its masked CRC-32C."""
    data = event.SerializeToString()
    header = struct.pack('<Q', len(data))
    crc = tensorboardX.record_writer.masked_crc32c
    self._file.write(header + struct.pack('<I', crc(header)) + data + struct.pack('<I', crc(data)))

  def close(self) -> None:
    """Closes the file, which io does even when the flush of what it buffered fails (raised)."""
    self._file.close()


class MetricsWriter:
  """Writes metric rows; owns the progress bar. Use as a context manager. `writes=False`: a
  process other than process 0 of a multi-process run, which shares the workdir and the numbers
  but writes and prints nothing."""

  def __init__(self, workdir: pathlib.Path, *, total_steps: int, start_step: int,
               progress_bar: bool = True, writes: bool = True):
    self.jsonl_path = pathlib.Path(workdir) / 'metrics.jsonl'
    self.total_steps = total_steps
    self.writes = writes
    # (step, perf_counter) when this process's first step was done (after its compilation): the
    # ETA's origin, so that it counts evaluations and checkpoints but not compiling.
    self._step, self._eta_origin = start_step, None
    if not writes:
      self._jsonl = self._tensorboard = None
      self._bar = tqdm.tqdm(total=total_steps, disable=True)
      return
    # Rows up to the resumed checkpoint's step were written before it was saved; any later ones
    # (and, on a fresh start, all of them: a killed first attempt's step-0 eval) are redone.
    self._drop_rows_after(start_step if start_step else -1)
    self._jsonl = open(self.jsonl_path, 'a', encoding='utf-8')
    # The same rows for TensorBoard, hiding the dropped rows of earlier files.
    self._tensorboard = EventFile(pathlib.Path(workdir) / 'tensorboard',
                                  purge_step=start_step + 1 if start_step else 0)
    self._bar = tqdm.tqdm(total=total_steps, initial=start_step, unit='step', dynamic_ncols=True,
                          disable=not bar_visible(progress_bar), leave=True)

  def _drop_rows_after(self, step: int) -> None:
    """On resume, forget rows a killed run logged after its last checkpoint (they get redone)."""
    if not self.jsonl_path.exists():
      return
    with open(self.jsonl_path, encoding='utf-8') as f:
      rows = [line for line in f if line.strip() and _row_step(line) is not None]
    kept = [line for line in rows if _row_step(line) <= step]
    fs.write_text_atomic(self.jsonl_path, ''.join(kept))

  def write(self, step: int, scalars: dict, console: bool = True) -> None:
    if not self.writes:
      return
    row = {'step': step, **{k: float(v) for k, v in scalars.items()}}
    with fs.naming(self.jsonl_path):  # a full disk: say where
      self._jsonl.write(json.dumps(row) + '\n')
      self._jsonl.flush()
    self._tensorboard.write(step, {name: value for name, value in row.items()
                                   if name != 'step' and math.isfinite(value)})
    if console:
      self.print(format_console_line(step, self.total_steps, scalars, self.eta_s(step)))

  def advance(self, steps: int = 1, loss: float | None = None) -> None:
    if loss is not None:
      self._bar.set_postfix(loss=f'{loss:.4f}', refresh=False)
    self._bar.update(steps)
    self._step += steps
    if self._eta_origin is None:
      self._eta_origin = (self._step, time.perf_counter())

  def eta_s(self, step: int) -> float | None:
    """Seconds to the last step at this process's pace since its first step (None before a second
    step is done, and at the end)."""
    if self._eta_origin is None or not self._eta_origin[0] < step < self.total_steps:
      return None
    origin_step, origin_time = self._eta_origin
    return (time.perf_counter() - origin_time) / (step - origin_step) * (self.total_steps - step)

  def print(self, line: str) -> None:
    """A console line that does not break the progress bar."""
    if self.writes:
      tqdm.tqdm.write(line)

  def close(self, quiet: bool = False) -> None:
    """Closes the files, each even when another's close fails (a full disk: the rows still
    buffered cannot be written). `quiet`: the run is already ending with an error, which a failed
    close must not replace (a full disk's, then an unnamed second one over it): its own is
    dropped; the rows it held are lost either way."""
    self._bar.close()
    if not self.writes:
      return
    errors = []
    for file, path in ((self._jsonl, self.jsonl_path), (self._tensorboard, self._tensorboard.path)):
      try:
        with fs.naming(path):
          file.close()
      except OSError as error:
        errors.append(error)
    if errors and not quiet:
      raise errors[0]

  def __enter__(self):
    return self

  def __exit__(self, exc_type, exc, traceback):
    self.close(quiet=exc is not None)


def append_row(path: pathlib.Path, row: dict) -> None:
  """Appends `row` as one JSON line to `path` (a history such as evals.jsonl: one write of a
  whole line, so rows of concurrent writers do not interleave)."""
  with open(path, 'a', encoding='utf-8') as f:
    f.write(json.dumps(row) + '\n')


_peak_seen = [0]  # the largest peak host_memory_gb has reported in this process, in bytes


def host_memory_gb() -> dict:
  """This process's resident memory now and at its peak so far, in GB (1e9 bytes): what the
  planner's `predicted_host_peak_gb` predicts (Linux: /proc/self/statm and ru_maxrss, in KiB)."""
  peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  rss_bytes = runtime.process_rss_bytes() or 0
  # The kernel updates ru_maxrss lazily (per-thread counters folded in now and then), so statm's
  # current figure can be a few pages above the peak it reports: the peak is at least the RSS,
  # and at least any peak reported before (ru_maxrss may not yet hold an RSS seen then).
  _peak_seen[0] = max(_peak_seen[0], peak_bytes, rss_bytes)
  return {'perf/host_rss_gb': rss_bytes / 1e9, 'perf/host_peak_gb': _peak_seen[0] / 1e9}



# Seconds this process has spent tracing, lowering and compiling jitted programs, summed from
# JAX's '/jax/core/compile/*' duration events once `compile_seconds` first runs.
_COMPILE_EVENTS = '/jax/core/compile/'
_compiling = {'seconds': 0.0, 'listening': False}


def compile_seconds() -> float:
  """Seconds spent compiling (tracing, lowering, XLA) since the first call, which starts
  listening to JAX's compile events: a step during which this grows compiled a program."""
  if not _compiling['listening']:
    from jax import monitoring  # pylint: disable=import-outside-toplevel  (jax loads lazily)
    monitoring.register_event_duration_secs_listener(_on_duration)
    _compiling['listening'] = True
  return _compiling['seconds']


def _on_duration(event: str, seconds: float, **_) -> None:
  if event.startswith(_COMPILE_EVENTS):
    _compiling['seconds'] += seconds


class RunLog(MetricsWriter):
  """The log of one training run: a MetricsWriter that also times the steps, derives throughput
  and MFU (when `peak_tflops`, a datasheet peak, is known), and stops a run whose loss is no
  longer finite.

  Step times leave out the steps that compiled a program (`compile_seconds`): the first a process
  runs, and a streamed step under exact clipping whose deferred layer updates run for the first
  time in the second; a row whose steps all compiled reports its last."""

  def __init__(self, workdir: pathlib.Path, *, total_steps: int, start_step: int, log_every: int,
               tokens_per_step: int, flops_per_step: float, peak_tflops: float | None,
               predicted_step_time_s: float, checkpointer, progress_bar: bool = True,
               writes: bool = True):
    """`checkpointer` (a checkpoint.Checkpointer) tells a diverged run where to resume from."""
    super().__init__(workdir, total_steps=total_steps, start_step=start_step,
                     progress_bar=progress_bar, writes=writes)
    self.start_step, self.log_every = start_step, log_every
    self.tokens_per_step, self.flops_per_step = tokens_per_step, flops_per_step
    self.peak_tflops, self.predicted_step_time_s = peak_tflops, predicted_step_time_s
    self.checkpointer = checkpointer
    self.last = {}  # the newest row `record` wrote, with its step
    self._timed_steps, self._timed_seconds = 0, 0.0
    compile_seconds()  # listening from here

  def timed_step(self, step: int, train_step, batch) -> dict:
    """Runs `train_step(batch)`, the step that makes `step` steps done, and waits for its loss.
    Returns its scalars with the perf/* ones at a logging step, else {}."""
    started, compiled = time.perf_counter(), compile_seconds()
    step_metrics = train_step(batch)
    loss = float(step_metrics['learning/loss'])  # waits for the step
    elapsed = time.perf_counter() - started
    if not math.isfinite(loss):
      raise self._diverged(loss, step)
    # The first step of a process compiles (a persistent-cache hit still traces), as may others.
    if step > self.start_step + 1 and compile_seconds() == compiled:
      self._timed_steps, self._timed_seconds = self._timed_steps + 1, self._timed_seconds + elapsed
    self.advance(1, loss)
    if not due(step, self.log_every, self.total_steps):
      return {}
    step_time = self._timed_seconds / self._timed_steps if self._timed_steps else elapsed
    self._timed_steps, self._timed_seconds = 0, 0.0
    tflops = self.flops_per_step / step_time / 1e12
    mfu = {'perf/mfu': tflops / self.peak_tflops} if self.peak_tflops else {}
    return {**{k: float(v) for k, v in step_metrics.items()},
            'perf/step_time_s': step_time,
            'perf/tokens_per_sec': self.tokens_per_step / step_time,
            'perf/tflops': tflops,
            **mfu,
            'perf/predicted_step_time_s': self.predicted_step_time_s,
            **host_memory_gb()}

  def record(self, step: int, scalars: dict) -> None:
    """Writes the row of `step` unless `scalars` is empty; it becomes `last`."""
    if scalars:
      self.write(step, scalars)
      self.last = {'step': step, **scalars}

  def _diverged(self, loss: float, step: int) -> TrainingDivergedError:
    newest = self.checkpointer.latest_step()
    where = (f'The newest checkpoint is step {newest} in {self.checkpointer.directory}; a rerun '
             'resumes from it.' if newest is not None else 'No checkpoint was written yet.')
    return TrainingDivergedError(
        f'loss is {loss} at step {step}: training diverged. {where} Lower train.lr, lengthen '
        'train.warmup_steps or set train.grad_clip (e.g. 1.0).')


def _row_step(line: str):
  try:
    return int(json.loads(line)['step'])
  except (ValueError, KeyError, TypeError):
    return None  # a torn last line from a killed run
