"""End to end on the CPU: training on real text lowers the validation loss; metrics are written;
a stopped run resumes to bitwise-identical metrics; a diverging run stops with a clear error."""

import contextlib
import dataclasses
import gzip
import io
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import time
import types

import pytest

from megatrain_jax import hardware
from megatrain_jax import imports
from megatrain_jax import metrics
from megatrain_jax import runtime
from megatrain_jax import train
from megatrain_jax.checkpoint import Checkpointer
from megatrain_jax.errors import ConfigError, StoreCorruptionError, TrainingDivergedError
from megatrain_jax.layout import Layout
from megatrain_jax.model import ModelConfig

from helpers import AS_ROOT, REPO_ROOT, read_rows, run_until_crash, small_config, tmpfs


def test_training_on_shakespeare_lowers_validation_loss(tmp_path, shared_data):
  config = small_config(shared_data / 'tinyshakespeare' / 'input.txt', train__steps=150,
                        train__batch_size=16, train__warmup_steps=10, train__lr=3e-3,
                        train__log_every=25, train__eval_every=50, train__eval_batches=8,
                        checkpoint__every=0)
  last = train.train_and_evaluate(config, str(tmp_path))
  rows = read_rows(tmp_path)
  evals = [r['eval/loss'] for r in rows if 'eval/loss' in r]
  start, end = evals[0], evals[-1]
  # Untrained, the loss is about ln(256) = 5.55 nats per byte. A byte-level model that has learnt
  # the character statistics of English plays reaches < 2.8 within 150 steps of 1k tokens.
  assert start > 5.0
  assert end < 2.8, evals
  assert evals == sorted(evals, reverse=True), evals  # every evaluation improves on the last
  assert last['step'] == 150 and math.isclose(last['eval/perplexity'], math.exp(end), rel_tol=1e-6)
  train_rows = [r for r in rows if 'learning/loss' in r]
  assert [r['step'] for r in train_rows] == [25, 50, 75, 100, 125, 150]
  for key in ('learning/loss', 'learning/grad_norm', 'learning/lr', 'perf/tokens_per_sec',
              'perf/step_time_s'):
    assert all(math.isfinite(r[key]) and r[key] > 0 for r in train_rows), key
  assert list((tmp_path / 'tensorboard').glob('events.out.tfevents.*'))
  assert Checkpointer(tmp_path, keep=1).latest_step() == 150
  # The process's memory as /proc and getrusage see it: JAX alone holds over 100 MB; the peak so
  # far never falls and is at least what is resident now (same units, 1e9 bytes).
  peaks = [r['perf/host_peak_gb'] for r in train_rows]
  assert all(0.1 < r['perf/host_rss_gb'] <= r['perf/host_peak_gb'] * 1.001 for r in train_rows)
  assert peaks == sorted(peaks)


def test_the_trainer_starts_without_torch_or_ipython_and_leaves_them_importable():
  """tensorboardX imports torch and flax.nnx imports IPython whenever installed (1.4 s and ~180
  MB, and 0.3 s, of a launch.py start); the package imports both without them
  (megatrain_jax/imports.py), and they still import afterwards for code that wants them."""
  probe = ('import sys; import megatrain_jax.train; '
           'print("torch" in sys.modules, "IPython" in sys.modules); '
           'import torch, IPython; print(torch.ones(2).sum().item(), callable(IPython.get_ipython))')
  env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), JAX_PLATFORMS='cpu')
  out = subprocess.run([sys.executable, '-c', probe], env=env, capture_output=True, text=True,
                       timeout=120, check=True).stdout.split()
  assert out == ['False', 'False', '2.0', 'True']


def test_import_without_leaves_loaded_packages_alone():
  """A package loaded already is not hidden (a notebook's IPython), and the marks of the hidden
  ones are gone after the import, whether it succeeded or not."""
  loaded = sys.modules['json']
  module = imports.import_without('megatrain_jax.fs', absent=('json', 'not_a_package_xyz'))
  assert module.__name__ == 'megatrain_jax.fs' and sys.modules['json'] is loaded
  assert 'not_a_package_xyz' not in sys.modules
  with pytest.raises(ImportError):
    imports.import_without('not_a_package_xyz', absent=('other_missing_xyz',))
  assert 'other_missing_xyz' not in sys.modules


def _learning_rows(rows):
  return [{k: v for k, v in r.items() if not k.startswith('perf/')} for r in rows]


@pytest.mark.parametrize('microbatches', [1, 3])
def test_resume_reproduces_uninterrupted_run_bitwise(tmp_path, shared_data, monkeypatch,
                                                     microbatches):
  data = shared_data / 'wikitext-2' / 'valid.txt'
  config = small_config(data, train__microbatches=microbatches, train__batch_size=4)
  train.train_and_evaluate(config, str(tmp_path / 'full'))
  expected = _learning_rows(read_rows(tmp_path / 'full'))

  run_until_crash(monkeypatch, config, tmp_path / 'resumed', crash_after_checkpoint=8)
  assert Checkpointer(tmp_path / 'resumed', keep=3).latest_step() == 8
  train.train_and_evaluate(config, str(tmp_path / 'resumed'))
  got = _learning_rows(read_rows(tmp_path / 'resumed'))
  assert got == expected  # bitwise: floats compared exactly, every step 1..12 and every eval
  assert [r['step'] for r in got if 'learning/loss' in r] == list(range(1, 13))


@pytest.mark.parametrize('start_step, kept', [(0, []), (4, [0, 2, 4])])
def test_metrics_rows_past_the_restart_step_are_dropped(tmp_path, start_step, kept):
  """Rows a killed run logged after its last checkpoint (all of them, on a fresh start) are
  redone by the rerun, so they must go: each step is logged once, in order, in metrics.jsonl and
  as TensorBoard reads its event files (an attempt writes one file; a rerun's purges the steps
  from the restart on), which stay readable to the rest of the team (the umask's mode)."""
  from tensorboard.backend.event_processing import event_accumulator
  earlier = [{'step': s, 'learning/loss': 5.0 - s / 10} for s in (0, 2, 4, 6, 8)]
  previous_umask = os.umask(0o022)
  try:
    with metrics.MetricsWriter(tmp_path, total_steps=10, start_step=0,
                               progress_bar=False) as writer:  # the killed attempt
      for row in earlier:
        writer.write(row['step'], {'learning/loss': row['learning/loss']}, console=False)
    with open(tmp_path / 'metrics.jsonl', 'a') as f:
      f.write('{"step": 9, "learn')  # torn by the kill
    time.sleep(1.05 - time.time() % 1)  # event files are named by the second they are opened
    with metrics.MetricsWriter(tmp_path, total_steps=10, start_step=start_step,
                               progress_bar=False) as writer:
      writer.write(start_step + 1, {'learning/loss': 1.5}, console=False)
      writer.write(start_step + 2, {'learning/loss': 1.25}, console=False)
  finally:
    os.umask(previous_umask)
  expected = [r for r in earlier if r['step'] in kept] + [
      {'step': start_step + 1, 'learning/loss': 1.5},
      {'step': start_step + 2, 'learning/loss': 1.25}]
  assert read_rows(tmp_path) == expected
  events = event_accumulator.EventAccumulator(str(tmp_path / 'tensorboard'))
  events.Reload()
  assert len(list((tmp_path / 'tensorboard').glob('events.out.tfevents.*'))) == 2
  assert [(e.step, e.value) for e in events.Scalars('learning/loss')] == [
      (r['step'], pytest.approx(r['learning/loss'], rel=1e-7)) for r in expected]  # float32
  assert oct((tmp_path / 'metrics.jsonl').stat().st_mode & 0o777) == oct(0o644)


def test_attempts_in_the_same_second_keep_their_own_event_files(tmp_path, monkeypatch):
  """Event files are named by the second they are opened: a rerun within the same second (an
  attempt that stopped at once, a scheduler's quick restart) truncated the earlier attempt's
  file. Each now has its own, and TensorBoard reads both in order."""
  from tensorboard.backend.event_processing import event_accumulator
  monkeypatch.setattr(metrics.time, 'time', lambda: 1_800_000_000.0)
  for start_step, step, loss in ((0, 1, 2.0), (1, 2, 1.0)):
    with metrics.MetricsWriter(tmp_path, total_steps=4, start_step=start_step,
                               progress_bar=False) as writer:
      writer.write(step, {'learning/loss': loss}, console=False)
  assert len(list((tmp_path / 'tensorboard').glob('events.out.tfevents.*'))) == 2
  events = event_accumulator.EventAccumulator(str(tmp_path / 'tensorboard'))
  events.Reload()
  assert [(e.step, e.value) for e in events.Scalars('learning/loss')] == [(1, 2.0), (2, 1.0)]


# A run's metrics as its disk fills: rows until an event file's write fails, then the run's own
# error (the checkpoint's DiskFullError, as the trainer raises it) while rows are still buffered.
_FILLED_METRICS = """
import pathlib, sys
from megatrain_jax import metrics, reliability
from megatrain_jax.errors import DiskFullError
workdir, disk = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
try:
  with metrics.MetricsWriter(workdir, total_steps=9999, start_step=0, progress_bar=False) as log:
    log.write(1, {'learning/loss': 1.0}, console=False)
    reliability.fill(disk, 0)
    try:
      for step in range(2, 9999):
        log.write(step, {'learning/loss': 1.0}, console=False)
    except OSError as error:
      print(f'{error.filename}: {error.strerror}')
    raise DiskFullError('checkpoint step 8: the disk is full')
except DiskFullError as error:
  sys.exit(f'error: {error}')
"""


@AS_ROOT
def test_a_full_disk_under_the_metrics_is_one_error(tmp_path):
  """The disk filled during a run: after its one error line came tensorboardX's tracebacks (its
  writer thread's, and its exit-time flush of the rows it could not write), and the metrics'
  close raised an unnamed OSError over the run's own error. Now the write's error names the
  event file, the run's error is the one that ends it, and nothing else reaches stderr. The
  event file is on a disk of its own (metrics.jsonl's has room), so its write is the one that
  fails."""
  workdir = tmp_path / 'run'
  workdir.mkdir()
  with tmpfs(1) as disk:
    (disk / 'tensorboard').mkdir()
    (workdir / 'tensorboard').symlink_to(disk / 'tensorboard')
    ran = subprocess.run([sys.executable, '-c', _FILLED_METRICS, str(workdir), str(disk)],
                         env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), capture_output=True,
                         text=True, timeout=60)
  assert ran.stderr == 'error: checkpoint step 8: the disk is full\n', ran.stderr
  assert ran.returncode == 1
  assert re.fullmatch(rf'{workdir}/tensorboard/events\.out\.tfevents\.\d+\.\S+: No space left '
                      r'on device\n', ran.stdout), ran.stdout


def test_a_close_that_fails_does_not_hide_the_error_the_run_ends_with(capsys):
  """The engine's and checkpointer's closes run as the run unwinds: a write-behind that failed
  with the run (a lost process's collective) must not replace the run's one-line error with its
  traceback (it is a note on stderr); with no error in flight, the close's own error is raised."""
  def failing_close():
    raise RuntimeError('write-behind failed')

  with pytest.raises(TrainingDivergedError, match='the run'):
    with contextlib.ExitStack() as stack:
      stack.push(train._closing(failing_close))
      raise TrainingDivergedError('the run')
  assert capsys.readouterr().err == ('note: while the run stopped, closing failed too: '
                                     'RuntimeError: write-behind failed\n')
  with pytest.raises(RuntimeError, match='write-behind failed'):
    with contextlib.ExitStack() as stack:
      stack.push(train._closing(failing_close))


def test_the_peak_host_memory_is_never_below_the_resident_memory(monkeypatch):
  """ru_maxrss lags /proc/self/statm by a few pages at times: perf/host_peak_gb must still read
  at least perf/host_rss_gb."""
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 + (1 << 20)
  monkeypatch.setattr(runtime, 'process_rss_bytes', lambda: rss)
  memory = metrics.host_memory_gb()
  assert memory['perf/host_rss_gb'] == rss / 1e9
  assert memory['perf/host_peak_gb'] == rss / 1e9


class _Stream(io.StringIO):
  def __init__(self, tty: bool):
    super().__init__()
    self.tty = tty

  def isatty(self):
    return self.tty


@pytest.mark.parametrize('tty', [True, False])
def test_the_bar_is_drawn_on_a_terminal_and_left_out_of_log_files(tmp_path, monkeypatch, tty):
  """A SLURM job's output or `| tee` is a file: a tqdm bar there appends a copy of itself per
  redraw. It is drawn only on a terminal (or in a notebook's kernel); the console lines go out
  either way, with an ETA at the pace since the first step."""
  stderr, stdout = _Stream(tty), _Stream(tty)
  monkeypatch.setattr(sys, 'stderr', stderr)
  monkeypatch.setattr(sys, 'stdout', stdout)
  monkeypatch.delitem(sys.modules, 'ipykernel', raising=False)
  now = [100.0]  # the first step done at 100 s, then 15 s per step
  monkeypatch.setattr(metrics.time, 'perf_counter', lambda: now[0])
  with metrics.MetricsWriter(tmp_path, total_steps=10, start_step=0) as writer:
    writer.advance(1, loss=2.0)  # step 1: the ETA's origin (after compiling)
    writer.write(1, {'learning/loss': 2.0})  # no pace yet
    now[0] = 130.0
    writer.advance(2, loss=1.5)
    writer.write(3, {'learning/loss': 1.5})  # 30 s for 2 steps, 7 to go: 105 s
    now[0] = 160.0
    writer.advance(2, loss=1.0)
    writer.write(5, {'learning/loss': 1.0})  # 60 s for 4 steps, 5 to go: 75 s
  lines = stdout.getvalue().splitlines()
  assert lines == ['step 1/10 | loss 2.0000', 'step 3/10 | loss 1.5000 | eta 01:45',
                   'step 5/10 | loss 1.0000 | eta 01:15']
  bar = stderr.getvalue()
  if tty:
    assert '\r' in bar and '5/10' in bar and 'loss=1.0000' in bar
  else:
    assert bar == ''
  # Process 1 of a multi-process run counts its steps too, and prints nothing.
  with metrics.MetricsWriter(tmp_path, total_steps=10, start_step=0, writes=False) as writer:
    writer.advance(1, loss=2.0)
    writer.write(1, {'learning/loss': 2.0})
  assert stdout.getvalue().splitlines() == lines and stderr.getvalue() == bar


def test_a_progress_bar_in_a_log_file_writes_lines(monkeypatch):
  """`--eval` has no console line of its own: into a file its bar writes whole lines (at most
  every LOG_LINE_S seconds, and at the end) instead of redraws joined by carriage returns."""
  stderr = _Stream(False)
  monkeypatch.setattr(sys, 'stderr', stderr)
  monkeypatch.delitem(sys.modules, 'ipykernel', raising=False)
  monkeypatch.setattr(metrics, 'LOG_LINE_S', 0.0)
  with metrics.progress_bar(3, unit='window', desc='eval') as bar:
    for _ in range(3):
      bar.update(1)
  lines = stderr.getvalue().split('\n')
  assert '\r' not in stderr.getvalue() and lines[-1] == ''
  assert lines[0].startswith('eval:   0%') and lines[-2].startswith('eval: 100%')
  assert '3/3' in lines[-2]
  with metrics.progress_bar(3, enabled=False, desc='eval') as bar:
    bar.update(3)
  assert stderr.getvalue().split('\n') == lines


def test_the_bar_follows_a_notebook_kernel_and_the_switch(monkeypatch):
  file = _Stream(False)
  monkeypatch.delitem(sys.modules, 'ipykernel', raising=False)
  assert not metrics.bar_visible(True, file)
  monkeypatch.setitem(sys.modules, 'ipykernel', types.ModuleType('ipykernel'))
  assert metrics.bar_visible(True, file)
  assert not metrics.bar_visible(False, _Stream(True))


def test_resume_refuses_other_model_shapes(tmp_path, shared_data):
  data = shared_data / 'tinyshakespeare' / 'input.txt'
  train.train_and_evaluate(small_config(data, train__steps=2, checkpoint__every=2), str(tmp_path))
  wider = small_config(data, train__steps=4, model__d_model=128)
  with pytest.raises(ConfigError, match='model.d_model'):
    train.train_and_evaluate(wider, str(tmp_path))


def test_resume_keeps_the_microbatches_the_run_started_with(tmp_path, shared_data):
  """`train.microbatches=0` (auto) is resolved once: a resumed run keeps the recorded M, even
  where a fresh plan would choose another."""
  data = shared_data / 'tinyshakespeare' / 'input.txt'
  auto = small_config(data, train__steps=4, checkpoint__every=2, train__microbatches=0)
  _, fresh = train.plan_for(auto, tmp_path / 'elsewhere', dry_run=False)
  started_with = 1 if fresh.microbatches != 1 else 2
  train.train_and_evaluate(small_config(data, train__steps=2, checkpoint__every=2,
                                        train__microbatches=started_with), str(tmp_path))
  train.train_and_evaluate(auto, str(tmp_path))
  meta = json.loads((tmp_path / 'checkpoints' / '4' / 'meta.json').read_text())
  assert meta['step'] == 4 and meta['microbatches'] == started_with != fresh.microbatches
  assert auto.train.microbatches == 0  # the caller's config is left as it was
  assert json.loads((tmp_path / 'config.json').read_text())['train']['microbatches'] == started_with


def _resumer(tmp_path, shared_data, capsys, keep):
  """(resume, corpus): resume(steps, **overrides) trains the run in tmp_path/run to `steps` on
  60 KB of Shakespeare (the corpus file; a checkpoint every step) and returns the console lines
  `keep` accepts."""
  data = tmp_path / 'corpus.txt'
  data.write_text((shared_data / 'tinyshakespeare' / 'input.txt').read_text()[:60_000])

  def resume(steps, **overrides):
    capsys.readouterr()
    train.train_and_evaluate(small_config(data, train__steps=steps, checkpoint__every=1,
                                          **overrides), str(tmp_path / 'run'))
    return [line for line in capsys.readouterr().out.splitlines() if keep(line)]
  return resume, data


def test_resume_on_other_data_says_what_changed(tmp_path, shared_data, capsys):
  """A checkpoint records a digest of the next samples and the data fields: resuming on the
  same data says nothing; on another train.seed, or the same config over changed files, the run
  goes on and a warning says so, naming the fields that changed."""
  resume, data = _resumer(tmp_path, shared_data, capsys, lambda line: 'other data' in line)
  assert resume(1) == [] and resume(2) == []
  first, second = [row for row in read_rows(tmp_path / 'run') if 'data/epoch' in row]
  assert first['data/learned_fraction'] == second['data/learned_fraction'] == 1.0  # plain text
  assert second['data/epoch'] == pytest.approx(2 * first['data/epoch']) and first['data/epoch'] > 0
  meta = json.loads((tmp_path / 'run' / 'checkpoints' / '2' / 'meta.json').read_text())
  assert meta['data']['fields']['train.seed'] == 0 and len(meta['data']['next_samples']) == 16
  assert meta['data']['samples'] == 8 and meta['data']['tokenizer'] == 'byte'  # the whole step
  warned = resume(3, train__seed=1)
  assert len(warned) == 1 and 'checkpoint step 2 was trained on other data: train.seed 0 -> 1' \
      in warned[0] and 'set those fields back' in warned[0]
  data.write_text(data.read_text()[::-1])  # the same size, other text
  warned = resume(4, train__seed=1)
  assert len(warned) == 1 and 'the same config, but the data as prepared now differs' in warned[0]
  assert resume(5, train__seed=1) == []  # trained on these since


def test_a_resume_sees_a_change_anywhere_in_the_next_step(tmp_path, shared_data, capsys,
                                                         monkeypatch):
  """The digest a checkpoint records covers the whole next step (its 16 samples here: it was
  the first 4, so data changed after them resumed in silence); the record of an earlier version
  (4 samples, no count) is compared as it was made."""
  from megatrain_jax.data import loader  # pylint: disable=import-outside-toplevel
  resume, _ = _resumer(tmp_path, shared_data, capsys, lambda line: 'other data' in line)
  with monkeypatch.context() as patch:  # the record of an earlier version
    patch.setattr(train, '_data_record', lambda config, sampler, position: {
        'next_samples': sampler.digest(position), 'fields': train._data_fields(config)})
    assert resume(1, train__microbatches=2) == []
  assert resume(2, train__microbatches=2) == []  # compared as made: the same data
  meta = json.loads((tmp_path / 'run' / 'checkpoints' / '2' / 'meta.json').read_text())
  assert meta['data']['samples'] == 16
  # Samples 5-16 of the next step changed, the first 4 as they were: seen.
  digest = loader.BatchSampler.digest
  monkeypatch.setattr(loader.BatchSampler, 'digest', lambda self, position, count=4: (
      digest(self, position, count) if count <= 4 else 'changed after the 4th'))
  warned = resume(3, train__microbatches=2)
  assert len(warned) == 1 and 'checkpoint step 2 was trained on other data' in warned[0]


def test_a_resume_with_another_tokenizer_at_the_same_path_is_refused(tmp_path, capsys):
  """A checkpoint records the content hash of the tokenizer its ids are of: a tokenizer.json
  replaced at the same data.tokenizer path is refused on resume (its ids name other tokens to the
  embeddings), before anything is written; the same tokenizer resumes."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  from tokenizers import models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel
  text = (REPO_ROOT.parent / 'shared' / 'data' / 'tinyshakespeare' / 'input.txt').read_text()
  corpus = tmp_path / 'corpus.txt'
  corpus.write_text(text[:40_000])

  def tokenizer(vocab_size):
    tok = tokenizers.Tokenizer(models.BPE(unk_token='<unk>'))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([text[:40_000]], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=['<unk>', '</s>'], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (tmp_path / 'tok').mkdir(exist_ok=True)
    tok.save(str(tmp_path / 'tok' / 'tokenizer.json'))
    (tmp_path / 'tok' / 'tokenizer_config.json').write_text('{"eos_token": "</s>"}')

  def run(steps):
    return train.train_and_evaluate(small_config(
        corpus, train__steps=steps, checkpoint__every=1, data__tokenizer=str(tmp_path / 'tok'),
        model__vocab_size=512), str(tmp_path / 'run'))
  tokenizer(400)
  run(1)
  run(2)  # the same tokenizer: resumes
  tokenizer(420)  # another one, at the same path
  with pytest.raises(ConfigError, match=r'data.tokenizer=.*tok is not the tokenizer checkpoint '
                     r'step 2 trained with \(its content was hf:\w+, now hf:\w+\): its ids '
                     r'would name other tokens .*Put back the tokenizer.json'):
    run(3)
  assert not (tmp_path / 'run' / 'checkpoints' / '3').exists()


def test_damaged_prepared_data_stops_the_run_before_its_next_checkpoint(tmp_path, shared_data,
                                                                       capsys):
  """A flipped bit in a prepared token shard: the run trained on it silently (the resume's
  digest covers a few samples). The prepare step records each file's crc32; a run reads them
  all beside training and stops at the checkpoint after it finds one (its last waits for them
  all), naming the file; prepared again, the run resumes from the checkpoint before."""
  resume, _ = _resumer(tmp_path, shared_data, capsys, lambda line: False)
  resume(2)
  shard = tmp_path / 'run' / 'data' / 'train-00000.bin'
  meta = json.loads((tmp_path / 'run' / 'data' / 'meta.json').read_text())
  assert set(meta['checksums']) == {'train-00000.bin'}
  damaged = bytearray(shard.read_bytes())
  damaged[1000] ^= 1
  shard.write_bytes(bytes(damaged))
  with pytest.raises(StoreCorruptionError, match=rf'prepared data {shard} is damaged \(its crc32 '
                     rf'is [0-9a-f]{{8}}, the prepare step wrote [0-9a-f]{{8}}\).*Delete '
                     rf'{tmp_path / "run" / "data"} and prepare it again'):
    resume(3)  # its last checkpoint waits for every file to be read
  assert Checkpointer(tmp_path / 'run', keep=3).steps() == [1, 2]
  shutil.rmtree(tmp_path / 'run' / 'data')
  resume(4)
  assert Checkpointer(tmp_path / 'run', keep=3).steps() == [2, 3, 4]


def test_resume_with_other_settings_names_them(tmp_path, shared_data, capsys):
  """A resume takes the settings it is given; those that change the steps ahead (the schedule,
  AdamW, the document mask, the model's rope and norms, the microbatches) are named against the
  ones the run trained with, once."""
  resume, _ = _resumer(tmp_path, shared_data, capsys, lambda line: line.startswith('note: res'))
  assert resume(1) == []
  noted = resume(2, train__lr=5e-4, model__document_mask=True)
  assert len(noted) == 1 and noted[0].startswith(
      'note: resuming from step 1 with model.document_mask False -> True; train.steps 1 -> 2; '
      'train.lr 0.003 -> 0.0005 (the run trained with the values on the left)'), noted
  assert resume(3, train__lr=5e-4, model__document_mask=True) == [
      'note: resuming from step 2 with train.steps 2 -> 3 (the run trained with the values on the '
      'left): the steps from here differ from those of the run as it was']
  # The model's function (rope, norms) and the tokens per step: they changed silently.
  noted = resume(4, train__lr=5e-4, model__document_mask=True, model__rope_theta=20000.0,
                 model__norm_eps=1e-6, train__microbatches=2)
  assert len(noted) == 1 and noted[0].startswith(
      'note: resuming from step 3 with model.rope_theta 10000.0 -> 20000.0; model.norm_eps 1e-05 '
      '-> 1e-06; train.steps 3 -> 4; train.microbatches 1 -> 2 (the run'), noted


def test_early_stopping_counts():
  """EarlyStopping as Hugging Face's callback: the first evaluation is the best so far; one that
  does not beat the best by more than the threshold counts; `patience` of them in a row stop."""
  early = metrics.EarlyStopping(patience=2, threshold=0.1)
  assert [early.update(step, loss) for step, loss in
          enumerate([3.0, 2.5, 2.45, 2.3, 2.35, 2.28], 1)] == [False] * 5 + [True]
  assert (early.best, early.best_step, early.evals_since_best) == (2.3, 4, 2) and early.stopped
  again = metrics.EarlyStopping.resumed(2, 0.1, metrics.EarlyStopping(2, 0.1, 2.3, 4, 1).state())
  assert again.update(7, 2.25) and not metrics.EarlyStopping(0, 0.0).update(1, 1.0)
  at_the_end = metrics.EarlyStopping.resumed(2, 0.1, again.state())
  assert not at_the_end.update(8, 2.3, last=True) and not at_the_end.stopped  # ended as planned


def test_early_stopping_ends_the_run_and_resumes_its_count(tmp_path, shared_data, capsys):
  """train.early_stopping_patience=2 with a threshold no step beats: evaluation 1 sets the best,
  2 and 3 count, so the run ends at step 3 with a checkpoint; a run resumed from step 2 (one
  counted) ends at 3 too; a rerun has nothing to do; eval_every=0 is refused."""
  data = shared_data / 'tinyshakespeare' / 'input.txt'
  stopping = dict(train__eval_every=1, checkpoint__every=1, train__early_stopping_patience=2,
                  train__early_stopping_threshold=100.0)
  for name, first_steps in (('straight', 0), ('resumed', 2)):
    workdir = tmp_path / name
    if first_steps:
      train.train_and_evaluate(small_config(data, train__steps=first_steps, **stopping),
                               str(workdir))
    capsys.readouterr()
    last = train.train_and_evaluate(small_config(data, train__steps=10, **stopping), str(workdir))
    assert last['step'] == 3 and 'early stop at step 3' in capsys.readouterr().out
    assert read_rows(workdir)[-1]['step'] == 3
    meta = json.loads((workdir / 'checkpoints' / '3' / 'meta.json').read_text())
    assert meta['early_stopping']['stopped'] and meta['early_stopping']['best_step'] == 1
  assert train.train_and_evaluate(small_config(data, train__steps=10, **stopping),
                                  str(workdir)) == {}
  assert 'stopped early at step 3' in capsys.readouterr().out
  with pytest.raises(ConfigError, match='train.early_stopping_patience: counts evaluations'):
    train.train_and_evaluate(small_config(data, **{**stopping, 'train__eval_every': 0}),
                             str(tmp_path / 'refused'))


def test_diverging_loss_stops_with_the_step(tmp_path, shared_data):
  config = small_config(shared_data / 'tinyshakespeare' / 'input.txt', train__lr=1e9,
                        train__warmup_steps=0, train__grad_clip=0.0, train__steps=20,
                        checkpoint__every=0)
  with pytest.raises(TrainingDivergedError,
                     match=r'at step \d+: training diverged. No checkpoint was written yet.*train.lr'):
    train.train_and_evaluate(config, str(tmp_path))


# ------------------------------------------------------------------------------------------------
# The console, as a newcomer reads it.
# ------------------------------------------------------------------------------------------------

def test_console_names_the_workdir_and_a_rerun_has_nothing_to_do(tmp_path, shared_data, capsys):
  """The first lines name the workdir and what goes there (each named output is there after the
  run); a CPU run (here with a calibrated profile: no datasheet peak) shows no MFU; a rerun of the
  finished run says so and writes nothing."""
  profile = dataclasses.replace(hardware.PRESETS['cpu'], name='calibrated-cpu',
                                source='calibrated on a test machine')
  hardware.save_profile(profile, tmp_path / 'profile.json')
  workdir = tmp_path / 'run'
  config = small_config(shared_data / 'tinyshakespeare' / 'input.txt', train__steps=2,
                        checkpoint__every=0, hardware=str(tmp_path / 'profile.json'))
  train.train_and_evaluate(config, str(workdir))
  out = capsys.readouterr().out
  lines = out.splitlines()
  assert lines[0] == f'workdir: {workdir} (rerun the same command to resume; docs/outputs.md)'
  for name in ('metrics.jsonl', 'tensorboard/', 'checkpoints/', 'config.json', 'data/'):
    assert name in lines[1] and (workdir / name).exists(), (name, lines[1])
  assert 'step 2/2 | loss' in out and 'mfu' not in out
  rows = read_rows(workdir)
  assert all('perf/mfu' not in r for r in rows)
  assert [r['step'] for r in rows if r.get('perf/tflops', 0) > 0] == [1, 2]

  written = {p: p.stat().st_mtime_ns for p in workdir.rglob('*') if p.is_file()}
  assert train.train_and_evaluate(config, str(workdir)) == {}
  lines = capsys.readouterr().out.splitlines()  # no 'rerun the same command to resume' first
  assert lines == ['nothing to do: step 2 of 2; raise --config.train.steps to continue']
  assert {p: p.stat().st_mtime_ns for p in workdir.rglob('*') if p.is_file()} == written


def _traces(workdir) -> list:
  files = list((workdir / 'profile' / 'plugins' / 'profile').glob('*/*.trace.json.gz'))
  assert len(files) == 1 and list(files[0].parent.glob('*.xplane.pb')), files
  return json.loads(gzip.decompress(files[0].read_bytes()))['traceEvents']


@pytest.mark.parametrize('placement', [{}, dict(offload__params='host', offload__opt_state='host',
                                               offload__layers_per_group=1)],
                         ids=['resident', 'streamed'])
def test_profile_traces_the_steps_asked(tmp_path, shared_data, capsys, placement):
  """profile.start_step=2, steps=2 of a 4-step run: one trace in <workdir>/profile whose step
  annotations are steps 2 and 3 only, holding the engine's jitted step functions by name; the
  console says where it is."""
  workdir = tmp_path / 'run'
  config = small_config(shared_data / 'tinyshakespeare' / 'input.txt', train__steps=4,
                        checkpoint__every=0, train__eval_every=0, profile__start_step=2,
                        profile__steps=2, **placement)
  train.train_and_evaluate(config, str(workdir))
  assert f'profile: steps 2-3 traced into {workdir / "profile"}' in capsys.readouterr().out
  events = _traces(workdir)
  steps = sorted(int(e['args']['step_num']) for e in events if e.get('name') == 'train')
  assert steps == [2, 3]
  functions = {e['name'] for e in events if e.get('name', '').startswith('PjitFunction(')}
  # The streamed engine's programs by their stage names (not their sharding wrapper's).
  want = ['train_step'] if not placement else ['group_forward', 'group_backward']
  assert {f'PjitFunction({name})' for name in want} <= functions, '; '.join(sorted(functions))


def test_epochs_count_the_steps_from_the_prepared_data(tmp_path, shared_data, capsys):
  """train.epochs: the run takes ceil(epochs * windows / samples per step) steps of the data it
  prepared (said on the console), a rerun counts the same and has nothing to do (writing
  nothing), and more epochs continue the run."""
  text = (shared_data / 'tinyshakespeare' / 'input.txt').read_text()
  (tmp_path / 'train.txt').write_text(text[:3300])  # 50 windows of 65 tokens
  (tmp_path / 'val.txt').write_text(text[-3000:])
  workdir = tmp_path / 'run'
  config = small_config(tmp_path / 'train.txt', data__val_path=str(tmp_path / 'val.txt'),
                        train__epochs=0.5, train__steps=1000, checkpoint__every=0)
  train.train_and_evaluate(config, str(workdir))
  assert train.epoch_steps(0.5, 50, 8) == 4  # ceil(25 / 8)
  out = capsys.readouterr().out
  assert 'train.epochs=0.5: 4 steps of 8 samples over 50 windows of 65 tokens' in out
  assert Checkpointer(workdir, keep=1).latest_step() == 4
  assert json.loads((workdir / 'config.json').read_text())['train']['steps'] == 4

  written = {p: p.stat().st_mtime_ns for p in workdir.rglob('*') if p.is_file()}
  assert train.train_and_evaluate(config, str(workdir)) == {}
  assert capsys.readouterr().out.splitlines()[-1] == (
      'nothing to do: step 4 of 4; raise --config.train.epochs to continue')
  assert {p: p.stat().st_mtime_ns for p in workdir.rglob('*') if p.is_file()} == written

  config.train.epochs = 1.0
  last = train.train_and_evaluate(config, str(workdir))
  assert last['step'] == 7 == train.epoch_steps(1.0, 50, 8)  # ceil(50 / 8)

  # Another batch size on resume: the samples left (50 * 1.5 - 56 = 19) at the new size, 4 a
  # step, so the run ends at the same pass (counted at 4 a step from the start: 19 steps, 1.2
  # passes too many; at 16 a step it had nothing to do).
  config.train.epochs, config.train.batch_size = 1.5, 4
  capsys.readouterr()
  last = train.train_and_evaluate(config, str(workdir))
  assert last['step'] == 7 + 5 == train.epoch_steps(1.5, 50, 4, 7, 56)
  assert ('train.epochs=1.5: 12 steps of 4 samples over 50 windows of 65 tokens (5 from step 7, '
          'where 56 samples had been read)') in capsys.readouterr().out
  meta = json.loads((workdir / 'checkpoints' / '12' / 'meta.json').read_text())
  assert meta['data_position'] == 56 + 5 * 4 >= 1.5 * 50


@pytest.mark.parametrize('peak', [None, 0.5])
def test_mfu_only_against_a_datasheet_peak(tmp_path, capsys, peak):
  """`perf/mfu` (and the console's `mfu`) is a fraction of a datasheet peak, or absent."""
  with metrics.RunLog(tmp_path, total_steps=1, start_step=0, log_every=1, tokens_per_step=100,
                      flops_per_step=1e12, peak_tflops=peak, predicted_step_time_s=1.0,
                      checkpointer=None, progress_bar=False) as log:
    log.record(1, log.timed_step(1, lambda batch: {'learning/loss': 2.0}, None))
  row, = read_rows(tmp_path)
  out = capsys.readouterr().out
  if peak is None:
    assert 'perf/mfu' not in row and 'mfu' not in out and row['perf/tflops'] > 0
  else:
    assert row['perf/mfu'] == pytest.approx(row['perf/tflops'] / peak)
    assert f'mfu {100 * row["perf/mfu"]:.1f}%' in out


def test_the_reported_peak_never_falls(monkeypatch):
  """perf/host_peak_gb is at least the RSS and at least every peak reported before: the kernel
  folds RSS into ru_maxrss lazily, so a row whose RSS stood above ru_maxrss reported a peak that
  the next row's ru_maxrss had not yet caught up with (a falling peak: 2.45431 then 2.45425)."""
  samples = iter([(100, 110), (105, 90), (120, 95)])  # (ru_maxrss KiB, RSS KiB) per row
  now = {}

  def getrusage(who):
    now['ru'], now['rss'] = next(samples)
    return types.SimpleNamespace(ru_maxrss=now['ru'])
  monkeypatch.setattr(metrics.resource, 'getrusage', getrusage)
  monkeypatch.setattr(metrics.runtime, 'process_rss_bytes', lambda: now['rss'] * 1024)
  monkeypatch.setattr(metrics, '_peak_seen', [0])
  peaks = [metrics.host_memory_gb()['perf/host_peak_gb'] * 1e9 / 1024 for _ in range(3)]
  assert peaks == pytest.approx([110, 110, 120])


def test_mfu_peak_is_the_datasheet_peak_of_the_run_devices(monkeypatch):
  """On the CPU there is none (the profile's measured rate is no peak); on a known accelerator,
  its datasheet figure for the run's precision."""
  cfg = ModelConfig(vocab_size=97, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, d_ff=48,
                    max_seq_len=64)
  assert train._mfu_peak_tflops(cfg, Layout.single_device()) is None
  monkeypatch.setattr(hardware, 'datasheet_peak_tflops',
                      lambda kind, dtype, precision: {'float32': 67.0}[dtype])
  assert train._mfu_peak_tflops(cfg, Layout.single_device()) == 67.0


def test_a_streamed_run_trims_the_heap_above_its_plans_host_peak(tmp_path, shared_data,
                                                                monkeypatch):
  """A streamed run's 'tuned' heap is trimmed above the plan's predicted host peak (x
  runtime.TRIM_MARGIN); a resident run's afterwards only above its bound (x
  RESIDENT_TRIM_MARGIN, at least RESIDENT_TRIM_FLOOR above its peak)."""
  plans, resolve_plan = [], train.resolve_plan

  def recording(*args, **kwargs):
    resolved = resolve_plan(*args, **kwargs)
    plans.append(resolved[2])  # (config, hardware, plan, restored)
    return resolved

  monkeypatch.setattr(train, 'resolve_plan', recording)
  text = shared_data / 'tinyshakespeare' / 'input.txt'
  try:
    train.train_and_evaluate(small_config(text, train__steps=1, checkpoint__every=0,
                                          offload__params='host', offload__opt_state='host'),
                             str(tmp_path / 'streamed'))
    if runtime.applied() is None:  # no glibc: nothing to configure
      return
    assert plans[-1].placement.streamed and runtime.applied() == 'tuned'
    assert runtime.TRIMMER.limit == pytest.approx(plans[-1].host_peak_bytes * runtime.TRIM_MARGIN)
    train.train_and_evaluate(small_config(text, train__steps=1, checkpoint__every=0),
                             str(tmp_path / 'resident'))
    assert not plans[-1].placement.streamed
    assert runtime.applied() == 'tuned'
    peak = plans[-1].host_peak_bytes
    assert runtime.TRIMMER.limit == pytest.approx(max(
        peak * runtime.RESIDENT_TRIM_MARGIN, peak + runtime.RESIDENT_TRIM_FLOOR))
  finally:
    runtime.configure_allocator('tuned')


def test_a_step_that_compiles_is_left_out_of_the_step_time(tmp_path):
  """perf/step_time_s leaves out every step that compiled a program (metrics.compile_seconds),
  not only a process's first: a streamed step under exact clipping compiles its deferred layer
  updates in the second, which made that row's step time twice the others'."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  compiled = []

  def train_step(batch):
    if batch in (1, 3):  # a program these steps meet first, as the deferred updates are met
      compiled.append(jax.jit(lambda x, k=batch: x * k + len(compiled))(jnp.ones(4)))
    time.sleep(0.3 if batch in (1, 3) else 0.05)
    return {'learning/loss': 1.0}

  with metrics.RunLog(tmp_path, total_steps=6, start_step=0, log_every=3, tokens_per_step=100,
                      flops_per_step=1e9, peak_tflops=None, predicted_step_time_s=1.0,
                      checkpointer=None, progress_bar=False) as log:
    for step in range(1, 7):
      log.record(step, log.timed_step(step, train_step, step - 1 if step > 1 else 99))
  first, second = read_rows(tmp_path)
  assert len(compiled) == 2
  assert first['perf/step_time_s'] < 0.15 and second['perf/step_time_s'] < 0.15
