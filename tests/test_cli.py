"""The command line (launch.py) and the bad-input table: each bad input is a clear ConfigError that
names the field and the fix, raised before anything is allocated or written."""

import dataclasses
import errno
import json
import os
import re
import shlex
import subprocess
import sys
import time

import pytest

from megatrain_jax import config as config_lib
from megatrain_jax import hardware
from megatrain_jax import train
from megatrain_jax.errors import ConfigError, DiskFullError

from helpers import AS_ROOT, REPO_ROOT, config_with, read_only_directory, tmpfs


def run_launch(*args, timeout=300):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  return subprocess.run([sys.executable, str(REPO_ROOT / 'launch.py'), *args], cwd=REPO_ROOT,
                        env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timing
@pytest.mark.parametrize('name, target, drives', [('101b', 101e9, 1), ('405b.py', 405e9, 4)])
def test_dry_run_of_the_largest_presets_is_fast_and_exact(name, target, drives, tmp_path):
  """101B and 405B plan for an H200 (405B's 25.7 TB of NVMe, 3 checkpoints kept, on four drives)."""
  profile = dataclasses.replace(hardware.load_profile('h200'), disks=drives,
                                disk_gb=drives * hardware.DRIVE_GB)
  started = time.monotonic()
  result = run_launch('--config', name, '--dry_run',
                      f'--config.hardware={hardware.save_profile(profile, tmp_path / "h200.json")}')
  elapsed = time.monotonic() - started
  assert result.returncode == 0, result.stderr
  lines = dict(line.split(':', 1) for line in result.stdout.splitlines() if ':' in line)
  params = int(lines['params'])
  assert abs(params - target) / target < 0.01
  state = int(lines['state_bytes'].split()[0].replace(',', ''))
  assert state == 16 * params  # FP32 params + grads + Adam m + Adam v
  # The memory plan and the prediction (planner.format_plan), ending with the machine-readable line.
  for word in ('device  total', 'host    total', 'nvme    total', 'bottleneck', 'tokens/s', 'MFU'):
    assert word in result.stdout
  last = result.stdout.strip().splitlines()[-1]
  assert last.startswith('predicted_step_time_s: ') and float(last.split(': ')[1]) > 0
  assert elapsed < 30, elapsed


def test_dry_run_that_fits_nowhere_shows_the_closest_plan_and_refuses():
  result = run_launch('--config', '101b', '--dry_run', '--config.hardware=cpu',
                      '--config.offload.host_memory_gb=16')
  assert result.returncode == 1
  assert 'no placement fits; the closest:' in result.stdout and 'nvme    total' in result.stdout
  assert 'error: this config fits no placement' in result.stderr
  assert 'GB needed' in result.stderr and 'Fix:' in result.stderr


def test_launch_trains_with_overrides(tmp_path, shared_data):
  workdir = tmp_path / 'run'
  result = run_launch('--config=tiny', '--config.train.steps=3', '--config.train.log_every=1',
                      '--config.model.num_layers=1', '--config.train.seq_len=32',
                      '--config.train.batch_size=2', '--config.train.eval_batches=1',
                      f'--config.data.path={shared_data / "tinyshakespeare" / "input.txt"}',
                      f'--workdir={workdir}')
  assert result.returncode == 0, result.stderr
  rows = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  assert [r['step'] for r in rows if 'learning/loss' in r] == [1, 2, 3]
  assert 'step 3/3 | loss' in result.stderr + result.stdout  # the console line
  assert 'note: train.warmup_steps=50 is not below train.steps=3' in result.stdout
  saved = json.loads((workdir / 'config.json').read_text())
  assert saved['train']['steps'] == 3 and saved['model']['num_layers'] == 1
  # Rerun without --config: the run's own config, with the command line's fields on top (it was
  # configs/default.py's: another model shape refused, a fine-tune's lr and data replaced).
  result = run_launch('--config.train.steps=4', f'--workdir={workdir}')
  assert result.returncode == 0, result.stderr
  assert (f"config: the run's own ({workdir / 'config.json'}, no --config given), with "
          '--config.train.steps=4') in result.stdout
  assert 'note: resuming from step 3 with train.steps 3 -> 4 (' in result.stdout, result.stdout
  assert 'warning' not in result.stdout + result.stderr
  rows = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  assert [r['step'] for r in rows if 'learning/loss' in r] == [1, 2, 3, 4]
  resumed = json.loads((workdir / 'config.json').read_text())
  assert resumed == dict(saved, train=dict(saved['train'], steps=4))
  planned = run_launch('--dry_run', f'--workdir={workdir}')  # plans that run, not the default
  assert planned.returncode == 0 and "config: the run's own" in planned.stdout, planned.stderr
  one_layer = run_launch('--dry_run', '--config=tiny', '--config.model.num_layers=1')
  assert planned.stdout.splitlines()[1] == one_layer.stdout.splitlines()[0]  # params: N


def _assert_one_error_line(result, fragment):
  """Exit status 1 and exactly one line on stderr, `error: ...` holding `fragment`."""
  assert result.returncode == 1, result.stderr
  assert len(result.stderr.splitlines()) == 1, result.stderr
  assert result.stderr.startswith('error: ') and fragment in result.stderr, result.stderr


# Without --config, ml_collections applies the overrides to configs/default.py as the flag is
# defined: each key is checked before that, as it is with --config.
@pytest.mark.parametrize('args, fragment', [
    (['--config.train.stpes=3'], "unknown config key 'train.stpes'. Did you mean 'steps'?"),
    (['--config', 'tiny', '--config.train.stpes=3'],
     "unknown config key 'train.stpes'. Did you mean 'steps'?"),
    (['--config.init.x=1'], "unknown config key 'init.x'. Keys in 'init': from_hf, from_run."),
    (['--config', 'tiny', '--config.init.x=1'], "unknown config key 'init.x'."),
    (['--config.nosuch.x=1'], "unknown config key 'nosuch.x': there is no section 'nosuch'."),
    (['--config.trian.steps=3'], "there is no section 'trian'. Did you mean 'train'?"),
], ids=['typo', 'typo-tiny', 'init-field', 'init-field-tiny', 'section', 'section-typo'])
def test_launch_reports_an_unknown_override_key(tmp_path, args, fragment):
  result = run_launch(*args, f'--workdir={tmp_path / "w"}')
  _assert_one_error_line(result, fragment)
  assert not (tmp_path / 'w').exists()


def test_the_readme_first_command_with_a_typo_is_one_line_of_error(tmp_path):
  """The README's first `python launch.py` command (the quick start), with a misspelled key: one
  line on stderr, nothing written (its default --workdir, runs/default, is under the cwd)."""
  command = re.search(r'python launch\.py[^\n&|;`]*', (REPO_ROOT / 'README.md').read_text())
  args = shlex.split(command.group(0))[2:]
  result = subprocess.run(
      [sys.executable, str(REPO_ROOT / 'launch.py'), *args, '--config.train.stpes=3'],
      cwd=tmp_path, env=dict(os.environ, JAX_PLATFORMS='cpu'), capture_output=True, text=True,
      timeout=300)
  _assert_one_error_line(result, "unknown config key 'train.stpes'. Did you mean 'steps'?")
  assert result.stdout == '' and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize('key, fragment', [
    ('train.stpes', "'train.stpes'. Did you mean 'steps'?"),
    ('init.x', "'init.x'. Keys in 'init': from_hf, from_run."),
    ('nosuch.x', "'nosuch.x': there is no section 'nosuch'. Sections: checkpoint, data,"),
    ('model.rope_scalng.type', "Did you mean 'model.rope_scaling'?"),
    ('nosuch', "'nosuch'. Keys in the top level: checkpoint,"),
    ('train.steps.x', "'train.steps' is a field, not a section"),
])
def test_unknown_keys_and_sections_say_what_there_is(key, fragment):
  """The command line's check and load_config's overrides (set_field) give the same message."""
  with pytest.raises(ConfigError, match='unknown config key') as error:
    config_lib.check_override(key, '1')
  assert fragment in str(error.value), str(error.value)
  with pytest.raises(ConfigError) as error:
    config_lib.load_config('tiny', **{key.replace('.', '__'): 1})
  assert fragment in str(error.value), str(error.value)


@pytest.mark.parametrize('args, fragment', [
    (['--eval', 'test.txt'], "unexpected argument 'test.txt': launch.py takes flags only; the file "
     "to evaluate is --config.eval.path='test.txt'."),
    (['--eval=test.txt'], "--eval=test.txt: --eval takes no value; the file to evaluate is "
     "--config.eval.path='test.txt'."),
    (['--sample', 'Once upon'], "unexpected argument 'Once upon': launch.py takes flags only; the "
     "prompt is --config.sample.prompt='Once upon'."),
    (['--config', 'tiny', 'steps=3', 'x'], "unexpected arguments 'steps=3' 'x': launch.py takes "
     'flags only; config fields are set as --config.<section>.<field>=value'),
], ids=['eval-word', 'eval-value', 'sample-word', 'words'])
def test_launch_refuses_words_that_are_not_flags(tmp_path, args, fragment):
  """absl passes a word that is not a flag on to main, which ignored it: `--eval test.txt` then
  evaluated nothing (eval.path empty) and `--sample 'Once'` sampled another prompt. Refused,
  naming what the word was meant for, before anything is written."""
  result = run_launch(*args, f'--workdir={tmp_path / "w"}')
  _assert_one_error_line(result, fragment)
  assert not (tmp_path / 'w').exists()


def test_a_config_file_whose_get_config_raises_is_one_line_naming_the_file_and_line(tmp_path):
  """A config file that assigns a float to an integer field raises inside ml_collections, which
  hands its whole traceback on inside absl's flag error. One line instead: the file, the line of
  it that raised and the exception, before anything is written."""
  config_file = tmp_path / 'mine.py'
  config_file.write_text('from megatrain_jax import config as config_lib\n\n\n'
                         'def get_config():\n'
                         '  config = config_lib.load_config("tiny")\n'
                         '  config.train.steps = 2.5\n'
                         '  return config\n')
  result = run_launch('--config', str(config_file), f'--workdir={tmp_path / "w"}')
  _assert_one_error_line(result, f'--config={config_file}: its get_config() raised at line 6 '
                         '(config.train.steps = 2.5): TypeError: Could not override field')
  assert 'Fix the config file.' in result.stderr and 'Traceback' not in result.stderr
  # An exception absl does not wrap (it wraps TypeError and ValueError only): one line too.
  config_file.write_text('def get_config():\n  return 1 / 0\n')
  result = run_launch('--config', str(config_file), f'--workdir={tmp_path / "w"}')
  _assert_one_error_line(result, f'--config={config_file}: its get_config() raised at line 2 '
                         '(return 1 / 0): ZeroDivisionError: division by zero. Fix the config')
  assert not (tmp_path / 'w').exists()


def test_launch_reports_an_unknown_config_name():
  result = run_launch('--config', 'no_such_size', '--dry_run')
  assert result.returncode != 0 and 'no_such_size' in result.stderr and 'tiny' in result.stderr


# ------------------------------------------------------------------------------------------------
# The bad-input table, in process: each case raises before the workdir is created.
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('overrides, field, fix', [
    (dict(model__d_model=250), 'model.d_model', 'num_heads dividing d_model'),
    (dict(model__num_kv_heads=3), 'model.num_kv_heads', 'num_kv_heads dividing num_heads'),
    (dict(train__seq_len=2048), 'train.seq_len', 'Lower train.seq_len'),
    (dict(data__path='/no/such/corpus.txt'), 'data.path', '/no/such/corpus.txt'),
    (dict(model__remat='sometimes'), 'model.remat', 'full'),
    (dict(train__microbatches=-1), 'train.microbatches', '>= 1, or 0 for auto'),
    (dict(data__tokenizer='/no/tokenizer.json'), 'data.tokenizer', '/no/tokenizer.json'),
    (dict(model__vocab_size=100), 'model.vocab_size=100', 'Raise model.vocab_size'),
    (dict(offload__params='disk'), 'offload.params', 'use one of device, host, nvme'),
    (dict(offload__params='nvme', offload__host_buffer_gb=0.001), 'offload.host_buffer_gb',
     'Raise offload.host_buffer_gb'),
    (dict(offload__prefetch_depth=-1), 'offload.prefetch_depth', '>= 1'),
])
def test_bad_config_values(tmp_path, overrides, field, fix):
  workdir = tmp_path / 'run'
  with pytest.raises(ConfigError) as error:
    train.train_and_evaluate(config_with(**overrides), str(workdir))
  assert field in str(error.value) and fix in str(error.value), str(error.value)
  assert not workdir.exists()


def test_unknown_key_in_a_config_file(tmp_path):
  config = config_with()
  config.unlock()
  config.train.stpes = 5
  with pytest.raises(ConfigError, match=r"unknown config key 'train.stpes'.*'steps'"):
    train.train_and_evaluate(config, str(tmp_path / 'run'))
  with pytest.raises(ConfigError, match="unknown config key 'train.lrr'"):
    config_lib.load_config('tiny', train__lrr=1.0)
  assert not (tmp_path / 'run').exists()


def test_workdir_not_writable(tmp_path):
  with read_only_directory() as locked:
    # root: a read-only mount, which no permission fixes (the message said to fix them)
    said = ('is on a read-only filesystem. Choose a workdir you can write to.$' if os.geteuid() == 0
            else 'is not writable. Choose a workdir you can write to, or fix its permissions.')
    with pytest.raises(ConfigError, match=r'--workdir=.*' + said):
      train.train_and_evaluate(config_with(), str(locked / 'run'))
  blocker = tmp_path / 'a_file'
  blocker.write_text('')
  with pytest.raises(ConfigError, match=r'--workdir=.*is a file'):
    train.train_and_evaluate(config_with(), str(blocker / 'run'))


@AS_ROOT
def test_calibrate_checks_where_it_writes_before_it_measures(tmp_path, monkeypatch, capsys):
  """--calibrate into a full offload.dir failed after a minute of measuring with a
  RESOURCE_EXHAUSTED traceback, a read-only one or --profile_out with an OSError's: each is
  refused before anything is measured; a profile that cannot be saved is printed, not lost."""
  measure = []
  monkeypatch.setattr(train.calibrate_lib, 'calibrate', lambda directory: measure.append(
      directory) or hardware.PRESETS['cpu'])
  config = config_with()
  with tmpfs(64) as disk:
    config.offload.dir = str(disk / 'offload')
    with pytest.raises(ConfigError, match=rf'--calibrate: the disk probe in {disk}/offload: the '
                                          rf'disk probe needs 285\.21 MB in {disk}, and 67\.\d\d '
                                          r'MB are free there\. Free space there, or point '
                                          'offload.dir'):
      train.calibrate(config, str(tmp_path / 'run'), str(tmp_path / 'hw.json'))
  config.offload.dir = ''
  with read_only_directory() as locked:
    with pytest.raises(ConfigError, match=rf'--profile_out={locked}/hw.json: {locked} is (not '
                                          r'writable|on a read-only filesystem)'):
      train.calibrate(config, str(tmp_path / 'run'), str(locked / 'hw.json'))
    with pytest.raises(ConfigError, match=rf'--calibrate: the disk probe in {locked}/run/offload: '
                                          rf'{locked} is (not writable|on a read-only filesystem)'):
      train.calibrate(config, str(locked / 'run'), str(tmp_path / 'hw.json'))
  assert measure == []

  def full(*args):
    raise OSError(errno.ENOSPC, 'No space left on device')

  monkeypatch.setattr(hardware, 'save_profile', full)
  with pytest.raises(DiskFullError, match=r'--calibrate: the profile could not be saved to .*hw.json '
                                          r'\(No space left on device\); it is printed above'):
    train.calibrate(config, str(tmp_path / 'run'), str(tmp_path / 'hw.json'))
  out = capsys.readouterr().out
  assert json.loads(out[out.index('{'):])['name'] == hardware.PRESETS['cpu'].name
