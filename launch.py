"""Command line: train a config, or print its size without allocating.

  python launch.py                                  # configs/default.py (tiny model, CPU minutes)
  python launch.py --config tiny --config.train.steps=50 --workdir runs/x
  python launch.py --config 101b --dry_run --config.hardware=h200  # plan for an H200, no allocation
  python launch.py --calibrate                      # measure this machine for the planner (< 60 s)
  python launch.py --prepare --config.data.path=corpus.jsonl.zst   # tokenize only (resumable)
  python launch.py --config.init.from_hf=/models/llama --workdir runs/ft   # fine-tune an HF model
  python launch.py --eval --workdir runs/ft --config.eval.path=test.txt  # sliding-window perplexity
  python launch.py --export_hf=/tmp/ft-hf --workdir runs/ft               # newest checkpoint -> HF
  python launch.py --sample --workdir runs/ft --config.sample.prompt='Once'  # text from the model
  python launch.py --config.parallel.devices=4                             # 4 local devices
  python launch.py --coordinator_address=node0:29500 --num_processes=2 --process_id=0  # 1 of 2

A bare config name resolves to configs/<name>.py. Every config field can be overridden with
--config.<section>.<field>=value.

Exit status: 0 when training completed, or when SIGTERM / SIGINT stopped it after saving a
checkpoint (rerun the same command to resume); 1 on an error (`error: ...`: bad input, a workdir
or offload.dir in use by another run, divergence, corruption, a full disk); killed by SIGINT (the
shell shows 130) when SIGINT came before training started or a second SIGINT cut a stop short
(the newest committed checkpoint is intact); killed by SIGTERM (143) when SIGTERM came before
training started (nothing trained yet). docs/preemption.md.
"""

import os
import re
import signal
import sys
import traceback

from absl import app
from absl import logging
from absl import flags
from ml_collections import config_flags

from megatrain_jax import config as config_lib
from megatrain_jax.errors import (ConfigError, DiskFullError, ProcessLostError,
                                  StoreCorruptionError, TrainingDivergedError)
from megatrain_jax.preemption import TrainingStopped

# --config is defined in __main__, once _preprocess_argv has checked the override keys: without
# --config on the command line, ml_collections loads the default file and applies the overrides
# as the flag is defined, and an unknown key there is a traceback, not `error: ...`.
_CONFIG = None


def _define_config_flag():
  return config_flags.DEFINE_config_file(
      'config', str(config_lib.CONFIGS_DIR / 'default.py'),
      'Config file, or a bare name from configs/ (tiny, 7b, 101b, ...).', lock_config=True)


_WORKDIR = flags.DEFINE_string('workdir', 'runs/default',
                               'Directory for checkpoints, metrics and TensorBoard logs.')
_DRY_RUN = flags.DEFINE_bool('dry_run', False,
                             'Print the parameter count, the memory plan and the predicted step '
                             'time, then exit.')
_CALIBRATE = flags.DEFINE_bool('calibrate', False,
                               'Measure this machine (compute, copies, AdamW, disk at offload.dir) '
                               'and save the hardware profile the planner uses, then exit.')
_EVAL = flags.DEFINE_bool('eval', False,
                           'Print the sliding-window perplexity on config.eval.path (any format '
                           'data.path takes: text, .jsonl(.zst/.gz), .parquet, a directory, a '
                           'glob) of the newest '
                           'checkpoint in --workdir (or of config.init.from_hf when it has none), '
                           'write <workdir>/eval.json, then exit.')
_SAMPLE = flags.DEFINE_bool('sample', False,
                            'Print config.sample.prompt continued by the newest checkpoint in '
                            '--workdir (or config.init.from_hf when it has none), then exit.')
_EXPORT_HF = flags.DEFINE_string('export_hf', '',
                                 'Write the newest checkpoint in --workdir as a Hugging Face '
                                 'checkpoint into this new (or empty) directory, then exit.')
_PREPARE = flags.DEFINE_bool('prepare', False,
                             'Tokenize config.data into its cache (data.num_workers processes, '
                             'resumable), print token counts and MB/s, then exit.')
_COORDINATOR = flags.DEFINE_string('coordinator_address', '',
                                   'host:port of process 0 of a multi-process run '
                                   '(jax.distributed); with --num_processes and --process_id.')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', 0,
                                      'Processes of a multi-process run (0 = single process).')
_PROCESS_ID = flags.DEFINE_integer('process_id', -1, 'This process\'s rank, 0..num_processes-1.')
_DISTRIBUTED = flags.DEFINE_bool('distributed', False,
                                 'Join a multi-process run whose coordinator, process count and '
                                 'rank JAX finds itself (cluster auto-detection: SLURM, ...).')
_INIT_TIMEOUT = flags.DEFINE_integer('initialization_timeout', 300,
                                     'Seconds a process of a multi-process run waits for all of '
                                     'them to join before it gives up.')
_PROFILE_OUT = flags.DEFINE_string('profile_out', '',
                                   'Where --calibrate writes the profile; default '
                                   '~/.cache/megatrain_jax/hardware.json (used when '
                                   'config.hardware is empty).')


def _preprocess_argv(argv: list[str]) -> list[str]:
  """Resolves `--config NAME` to a file and checks `--config.a.b=value` keys and value types,
  before absl parses."""
  out = list(argv)
  for i, arg in enumerate(out):
    if arg == '--config' and i + 1 < len(out):
      out[i + 1] = str(config_lib.resolve_config_path(out[i + 1]))
    elif arg.startswith('--config='):
      out[i] = '--config=' + str(config_lib.resolve_config_path(arg.split('=', 1)[1]))
    elif arg.startswith('--config.'):
      key, has_value, value = arg[len('--config.'):].partition('=')
      config_lib.check_override(key, value if has_value else None)
  return out


# What a value given to a job flag was meant for: `--eval test.txt` or `--sample 'Once'` read as
# `--eval` plus a stray word, `--eval=test.txt` as a boolean flag's value.
_MEANT_FOR = {'eval': ('the file to evaluate', 'eval.path'),
              'sample': ('the prompt', 'sample.prompt')}


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with its errors (unknown flag, missing value) printed as `error: ...`;
  a word that is not a flag is refused (absl would pass it on, and it would be ignored)."""
  for arg in argv[1:]:
    name, has_value, value = arg.lstrip('-').partition('=')
    if arg.startswith('--') and name in _MEANT_FOR and has_value and value.lower() not in (
        'true', 'false', '1', '0'):
      sys.exit(f'error: {arg}: --{name} takes no value; {_meant(name, value)}.')
  try:
    rest = flags.FLAGS(argv)
  except flags.Error as e:  # ml_collections hands on a config file's traceback inside it
    head, marker, trace = str(e).partition('Error whilst parsing config file:')
    path = head.strip().rstrip(':').split('=', 1)[-1]
    sys.exit(marker and _config_file_error(path, trace, raised_there=False) or
             f'error: {e}. Run with --helpshort to list the flags.')
  # absl wraps only a config file's TypeError and ValueError: the rest arrive as they are.
  except Exception:  # pylint: disable=broad-except
    message = _config_file_error(_config_path(argv), traceback.format_exc())
    if message is None:
      raise  # not raised by the config file: a bug, with its traceback
    sys.exit(message)
  if len(rest) > 1:
    jobs = [name for name in _MEANT_FOR if flags.FLAGS[name].value]
    hint = (_meant(jobs[0], rest[1]) if jobs and len(rest) == 2 else
            'config fields are set as --config.<section>.<field>=value, a config file as '
            '--config NAME')
    sys.exit(f'error: unexpected argument{"s" * (len(rest) > 2)} '
             f'{" ".join(repr(a) for a in rest[1:])}: launch.py takes flags only; {hint}. Run '
             'with --helpshort to list the flags.')
  return rest


def _config_path(argv: list[str]) -> str:
  """The config file the (preprocessed) command line names, else configs/default.py."""
  for i, arg in enumerate(argv):
    if arg == '--config' and i + 1 < len(argv):
      return argv[i + 1]
    if arg.startswith('--config='):
      return arg.split('=', 1)[1]
  return str(config_lib.CONFIGS_DIR / 'default.py')


def _config_file_error(path: str, trace: str, raised_there: bool = True) -> str | None:
  """One line for an exception raised while config file `path` was loaded (`trace`: its
  traceback): the file, the line of it that raised and the exception; None where `raised_there`
  and no frame of the traceback is in the file (not the config file's error: a bug)."""
  frames = re.findall(r'File "([^"]+)", line (\d+), in \S+\n +(.+)', trace)
  where = [f'line {line} ({code.strip()})' for file, line, code in frames if file == path]
  if raised_there and not where:
    return None
  lines = [line for line in trace.strip().splitlines() if line.strip()]
  raised = next((line.strip() for line in reversed(lines)
                 if re.match(r'[\w.]+(Error|Exception)\b.*:', line)), lines[-1].strip())
  at = f' at {where[-1]}' if where else ''
  return f'error: --config={path}: its get_config() raised{at}: {raised}. Fix the config file.'


def _meant(job: str, value: str) -> str:
  what, field = _MEANT_FOR[job]
  return f'{what} is --config.{field}={value!r}'


def _overrides() -> list[str]:
  """The config keys set on the command line (--config.a.b=...): with init.from_hf, a model
  shape field among them that disagrees with the checkpoint's config.json is an error."""
  return list(config_flags.get_override_values(flags.FLAGS['config']))


def _train(train):
  """train_and_evaluate. Outside its graceful stop, and as the way out of it (a second Ctrl-C),
  SIGINT ends the process at once (SIG_DFL: no Python, so not even a long XLA call delays it).
  Safe at any point: saves are atomic, and kill -9 is tested everywhere."""
  previous = signal.signal(signal.SIGINT, signal.SIG_DFL)
  try:
    train.train_and_evaluate(_run_config(), _WORKDIR.value, _overrides())
  except TrainingStopped:
    sys.exit(0)  # the checkpoint is committed; train printed 'stopped at step N by ...'
  finally:
    signal.signal(signal.SIGINT, previous)


def _run_config():
  """The config to train (prepare, plan) with: --config's; without --config, in a workdir that
  holds a run, the run's own (its config.json) with the command line's --config.* on top, so
  that `launch.py --workdir runs/ft` resumes the fine-tune it holds rather than
  configs/default.py's run (and --dry_run plans that resume)."""
  if flags.FLAGS['config'].present:
    return _CONFIG.value
  from megatrain_jax import distributed, runs  # pylint: disable=g-import-not-at-top
  recorded = runs.recorded_config(_WORKDIR.value, _CONFIG.value, _overrides())
  if recorded is None:
    return _CONFIG.value
  if distributed.is_main():
    given = ' '.join(f'--config.{key}={config_lib.get_field(_CONFIG.value, key)}'
                     for key in _overrides())
    print(f'config: the run\'s own ({os.path.join(_WORKDIR.value, "config.json")}, no --config '
          f'given){f", with {given}" if given else ""}', flush=True)
  return recorded


def _end_prepare(signum, frame) -> None:
  """SIGINT during --prepare: its worker processes ended, then this one, at once (130). The
  committed shards are kept and a rerun resumes after them. A KeyboardInterrupt instead could
  land in one of JAX's gc callbacks, which swallow it (the prepare went on to the end), or leave
  a page of tracebacks from the workers."""
  del signum, frame
  import multiprocessing  # pylint: disable=g-import-not-at-top
  for child in multiprocessing.active_children():
    child.terminate()
  print('\nprepare stopped by SIGINT: the shards written so far are kept; rerun the command to '
        'resume.', file=sys.stderr, flush=True)
  os._exit(130)  # pylint: disable=protected-access


def _fail(message: str, several_processes: bool, everyone: bool = False) -> None:
  """Ends the process with `message` on stderr and status 1. A process of a multi-process run
  ends at once (os._exit): jax.distributed's exit handler would wait at a shutdown barrier for the
  other processes while they wait for this one in their next collective, and the run would hang
  until the barrier timed out (minutes), then abort with a page of C++ log. Gone at once, it is
  seen as lost within distributed.HEARTBEAT_S, and the others stop with their own error. An error
  `everyone` meets (a refusal of the config they share) first waits for the others to say it too
  (distributed.stop_together)."""
  if not several_processes:
    sys.exit(message)
  print(message, file=sys.stderr, flush=True)
  sys.stdout.flush()
  if everyone:
    from megatrain_jax import distributed  # pylint: disable=g-import-not-at-top
    distributed.stop_together()
  os._exit(1)  # pylint: disable=protected-access


# The jobs that run in one process, and what to do instead: each reads or writes the workdir
# whole from one process (P processes would each do all of it, or fail on the shards of
# devices they cannot address).
_ONE_PROCESS_JOBS = {
    'prepare': 'process 0 of a training run prepares the data itself, the others wait',
    'calibrate': 'it measures one machine: run it on each machine',
    'dry_run': 'it allocates nothing; --config.parallel.devices=N plans for N devices',
    'export_hf': 'it reads a checkpoint written by any number of processes',
    'eval': 'it reads a checkpoint written by any number of processes',
    'sample': 'it reads a checkpoint written by any number of processes',
}
_PROCESS_FLAGS = ('coordinator_address', 'num_processes', 'process_id', 'distributed')


def _several_processes() -> bool:
  """Whether the flags ask for a run of several processes (jax.distributed), once they are
  checked: before anything starts or is written, a job that runs in one process, or process
  flags that are incomplete or out of range, end it with one `error:` line."""
  given = [f'--{name}' for name, on in zip(_PROCESS_FLAGS, (
      _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.present, _DISTRIBUTED.value)) if on]
  if not given or (not (_COORDINATOR.value or _DISTRIBUTED.value) and _NUM_PROCESSES.value <= 1
                   and _PROCESS_ID.value in (-1, 0)):
    return False  # one process (a launcher's template may pass --num_processes=1 --process_id=0)
  for job, why in _ONE_PROCESS_JOBS.items():
    if flags.FLAGS[job].present and flags.FLAGS[job].value is not False:
      flags_given = ' and '.join([', '.join(given[:-1]), given[-1]] if len(given) > 1 else given)
      sys.exit(f'error: --{job} runs in one process ({why}): run it once, without '
               f'{flags_given}.')
  from megatrain_jax import distributed  # pylint: disable=g-import-not-at-top
  try:
    distributed.check_process_flags(
        _COORDINATOR.value,
        _NUM_PROCESSES.value if _NUM_PROCESSES.present else None,
        _PROCESS_ID.value if _PROCESS_ID.present else None, _DISTRIBUTED.value,
        _INIT_TIMEOUT.value)
  except ConfigError as e:
    sys.exit(f'error: {e}')
  return True


def main(argv):
  del argv
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  several, joined = _several_processes(), False
  try:
    if several:  # before any device, and before anything is written
      from megatrain_jax import distributed  # pylint: disable=g-import-not-at-top
      distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                             _INIT_TIMEOUT.value)
      joined = True
      distributed.check_same_config(_CONFIG.value, _WORKDIR.value)
    from megatrain_jax import train  # pylint: disable=g-import-not-at-top  (`--help` stays fast)
    _run(train)
  except (ConfigError, TrainingDivergedError, StoreCorruptionError, DiskFullError,
          ProcessLostError) as e:
    _fail(f'error: {e}', several,  # ProcessLostError: only ever with several
          everyone=joined and (isinstance(e, (ConfigError, TrainingDivergedError))
                               or getattr(e, 'everyone', False)))
  except Exception:  # pylint: disable=broad-except  (a bug: its traceback, then the same exit)
    if not several:
      raise
    _fail(traceback.format_exc().rstrip(), several)


def _run(train):
  """The job the flags ask for."""
  if _PREPARE.value:
    signal.signal(signal.SIGINT, _end_prepare)
    train.prepare(_run_config(), _WORKDIR.value, _overrides())
  elif _CALIBRATE.value:
    train.calibrate(_CONFIG.value, _WORKDIR.value, _PROFILE_OUT.value)
  elif _DRY_RUN.value:
    train.dry_run(_run_config(), _WORKDIR.value, _overrides())
  elif _EXPORT_HF.present:
    train.export_hf(_CONFIG.value, _WORKDIR.value, _EXPORT_HF.value)
  elif _EVAL.value:
    train.evaluate(_CONFIG.value, _WORKDIR.value, _overrides())
  elif _SAMPLE.value:
    train.sample(_CONFIG.value, _WORKDIR.value, _overrides())
  else:
    _train(train)


if __name__ == '__main__':
  try:
    resolved = _preprocess_argv(sys.argv)
  except ConfigError as e:
    sys.exit(f'error: {e}')
  try:
    _CONFIG = _define_config_flag()
  except (flags.Error, KeyError, AttributeError) as e:  # what the checks above did not foresee
    sys.exit('error: --config: ' + ' '.join(str(e).split()))  # one line, like the rest
  app.run(main, argv=resolved, flags_parser=_parse_flags)
