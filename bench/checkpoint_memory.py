"""Host memory of checkpointing a resident state with a real vocabulary: bytes of peak RSS a save
adds over the RSS before it (next to a training step's peak), and bytes a restore adds over the
state's own size (peaks read from VmHWM, reset before each measure). Each measure runs in a fresh
process; `--code` compares another checkout (e.g. the format-2 checkpointer:
`git worktree add /tmp/ckold <commit>`).

  PYTHONPATH=. python bench/checkpoint_memory.py --dir /tmp/ckmem [--code /tmp/ckold]

Default model: vocabulary 128,256 x d_model 1024, tied, 1 layer: 143M params, a 1.72 GB state
(params + Adam m, v). Prints a table and one JSON line per code checkout.
"""

import argparse
import ctypes
import json
import os
import pathlib
import resource
import shutil
import subprocess
import sys
import time
import types

_GB = 1e9


def rss() -> int:
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith('VmRSS'):
        return int(line.split()[1]) * 1024
  return 0


def peak() -> int:
  """Peak RSS since the last `reset_peak` (VmHWM), or since the start where it cannot be reset."""
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith('VmHWM'):
        return int(line.split()[1]) * 1024
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def trim_heap() -> None:
  try:
    ctypes.CDLL(None).malloc_trim(0)
  except (OSError, AttributeError):
    pass


def reset_peak() -> None:
  """Linux >= 4.0: VmHWM restarts from the current RSS."""
  try:
    with open('/proc/self/clear_refs', 'w') as f:
      f.write('5')
  except OSError:
    pass


def child(mode: str, workdir: pathlib.Path, fields: dict) -> dict:
  """One measure, in this process: 'save' (init, one train step, save) or 'restore'."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from megatrain_jax import optim  # pylint: disable=g-import-not-at-top
  from megatrain_jax.checkpoint import Checkpointer  # pylint: disable=g-import-not-at-top
  from megatrain_jax.engine import resident  # pylint: disable=g-import-not-at-top
  from megatrain_jax.model import ModelConfig  # pylint: disable=g-import-not-at-top
  cfg = ModelConfig(**fields)
  train = types.SimpleNamespace(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
                                warmup_steps=1, steps=10, min_lr_ratio=0.1)
  tx = optim.make_optimizer(train)
  abstract = resident.abstract_state(cfg, tx)
  state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
  out = {'state_gb': state_bytes / _GB, 'start_rss_gb': rss() / _GB}
  checkpointer = Checkpointer(workdir, keep=1)
  if mode == 'save':
    engine = resident.ResidentEngine(cfg, tx, optim.lr_schedule(train), 1.0, seed=0)
    jax.block_until_ready(engine.state)
    out['after_init_rss_gb'] = rss() / _GB
    batch = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 1, 65)).astype(np.int32)
    jax.block_until_ready(engine.train_step(batch))  # compiles
    reset_peak()
    jax.block_until_ready(engine.train_step(batch))
    out['step_peak_gb'] = peak() / _GB
    trim_heap()  # what the step freed back to the OS: the same baseline for any checkpointer
    before = rss()
    out['before_save_rss_gb'] = before / _GB
    reset_peak()
    started = time.perf_counter()
    checkpointer.save(1, engine, data_position=0, model_cfg=cfg)
    out['save_returned_s'] = time.perf_counter() - started
    checkpointer.wait()
    out.update(save_s=time.perf_counter() - started, save_peak_gb=peak() / _GB,
               save_added_gb=(peak() - before) / _GB)
  else:
    reset_peak()
    before, started = rss(), time.perf_counter()
    reader = checkpointer.restore(cfg)
    out['verify_added_gb'] = (peak() - before) / _GB
    if hasattr(reader, 'device_state'):
      state = reader.device_state(abstract)
    else:  # the format-2 code: train.make_engine's restore of a resident run
      from megatrain_jax.layout import Layout  # pylint: disable=g-import-not-at-top
      state = Layout.single_device().put(reader.full_state(abstract), 'device')
    jax.block_until_ready(state)
    out.update(restore_s=time.perf_counter() - started, restore_peak_gb=peak() / _GB,
               restore_over_state_gb=(peak() - before - state_bytes) / _GB,
               after_restore_rss_gb=rss() / _GB)
  checkpointer.close()
  return out


def measure(code: pathlib.Path, mode: str, workdir: pathlib.Path, fields: dict) -> dict:
  env = dict(os.environ, PYTHONPATH=str(code), JAX_PLATFORMS=os.environ.get('JAX_PLATFORMS',
                                                                               'cpu'))
  result = subprocess.run([sys.executable, __file__, '--child', mode, '--dir', str(workdir),
                           '--fields', json.dumps(fields)], env=env, capture_output=True,
                          text=True, check=False)
  if result.returncode != 0:
    raise RuntimeError(f'{code} {mode} failed:\n{result.stderr[-3000:]}')
  return json.loads(result.stdout.strip().splitlines()[-1])


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--dir', default='/tmp/ckmem')
  parser.add_argument('--code', action='append', default=[],
                      help='checkouts to compare (default: this one)')
  parser.add_argument('--vocab', type=int, default=128_256)
  parser.add_argument('--d_model', type=int, default=1024)
  parser.add_argument('--layers', type=int, default=1)
  parser.add_argument('--child', help=argparse.SUPPRESS)
  parser.add_argument('--fields', help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    print(json.dumps(child(args.child, pathlib.Path(args.dir), json.loads(args.fields))))
    return
  fields = dict(vocab_size=args.vocab, d_model=args.d_model, num_layers=args.layers,
                num_heads=args.d_model // 64, num_kv_heads=args.d_model // 128,
                d_ff=int(args.d_model * 8 / 3) // 64 * 64, max_seq_len=64, tie_embeddings=True)
  codes = [pathlib.Path(c).absolute() for c in args.code] or [pathlib.Path(__file__).parents[1]]
  for code in codes:
    workdir = pathlib.Path(args.dir) / code.name
    shutil.rmtree(workdir, ignore_errors=True)
    saved = measure(code, 'save', workdir, fields)
    restored = measure(code, 'restore', workdir, fields)
    print(f'{code}: state {saved["state_gb"]:.2f} GB; RSS before the save '
          f'{saved["before_save_rss_gb"]:.2f} GB (a training step peaks at '
          f'{saved["step_peak_gb"]:.2f}); the save peaks {saved["save_added_gb"]:.3f} GB over it '
          f'({saved["save_s"]:.1f} s, training blocked {saved["save_returned_s"]:.1f} s); restore '
          f'peaks {restored["restore_over_state_gb"]:.3f} GB over the state (verify alone '
          f'{restored["verify_added_gb"]:.3f} GB; {restored["restore_s"]:.1f} s)', file=sys.stderr)
    print(json.dumps({'code': str(code), 'model': fields, 'save': saved, 'restore': restored}))


if __name__ == '__main__':
  main()
