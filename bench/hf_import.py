"""Importing a Hugging Face checkpoint onto the NVMe tier (`init.from_hf`), then one training step:
the process's peak RSS against the checkpoint's size, and the import's throughput against a plain
`safetensors` load of the same files.

  PYTHONPATH=. python bench/hf_import.py --dir /tmp/hfimport [--layers 60] [--keep]

Default model: a Llama of 60 layers x d_model 1024 (16 heads, 8 KV heads, d_ff 2816), vocabulary
32,000, untied: 773M params, a 3.09 GB float32 checkpoint in 1 GB shards, written tensor by tensor
(random normal, std 0.02) with the package's own exporter. Two fresh processes, each wrapped so
that its peak RSS is its own (getrusage RUSAGE_CHILDREN of a one-child wrapper):

  baseline  safetensors.numpy.load_file of every shard, kept (a whole-model load, as load_hf does)
  import    python launch.py --config.init.from_hf=<dir> with params, Adam state and embedding/
            head on NVMe (offload.dir under --dir), one layer per group, 1 step of 1 x 64 tokens
            (plus the step-0 evaluation), offload.shard_mb 32 (the 131 MB embedding and head
            move in 32 MB vocabulary chunks): the import (params read and written to the stores,
            Adam state registered as zeros, not written: tiers/nvme.py; every write landed) is
            timed by the trainer itself

The page cache is dropped before each when permitted (root), so both read the checkpoint cold.
Everything is deleted afterwards unless --keep. Prints a table and a JSON line.
"""

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import jax
import numpy as np

from megatrain_jax import export as export_lib
from megatrain_jax import fs
from megatrain_jax import model as model_lib

REPO = pathlib.Path(__file__).resolve().parents[1]
_GB = 1e9
_WRAP = ('import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); '
         'print("PEAK_RSS_KB", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, '
         'file=sys.stderr); sys.exit(r.returncode)')
_BASELINE = ('import sys, time, safetensors.numpy as st; t = time.perf_counter(); tensors = {}\n'
             'for f in sys.argv[1:]: tensors.update(st.load_file(f))\n'
             'n = sum(a.nbytes for a in tensors.values())\n'
             'print("LOADED", n, time.perf_counter() - t)')


class RandomReader:
  """A checkpoint reader (`read(path, start, stop, axis=)`) of random float32 weights."""

  def __init__(self, cfg: model_lib.ModelConfig, seed: int = 0):
    params = model_lib.abstract_params(cfg)
    self.shapes = {"['params']" + jax.tree_util.keystr(p): tuple(x.shape)
                   for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    self.rng = np.random.default_rng(seed)

  def read(self, path, start=None, stop=None, *, axis=0):
    shape = self.shapes[path]
    if start is not None:
      shape = shape[:axis] + (stop - start,) + shape[axis + 1:]
    if path.endswith("['scale']"):
      return np.ones(shape, np.float32)
    return self.rng.standard_normal(shape, np.float32) * np.float32(0.02)


def make_checkpoint(directory: pathlib.Path, layers: int, shard_gb: float) -> model_lib.ModelConfig:
  cfg = model_lib.ModelConfig(vocab_size=32000, d_model=1024, num_layers=layers, num_heads=16,
                              num_kv_heads=8, d_ff=2816, max_seq_len=2048, tie_embeddings=False)
  export_lib.export(RandomReader(cfg), cfg, directory, max_shard_bytes=int(shard_gb * _GB))
  return cfg


def run_measured(args: list[str], env: dict) -> tuple[str, str, float, float]:
  """(stdout, stderr, wall seconds, peak RSS GB) of one process."""
  dropped = fs.drop_page_cache()
  started = time.perf_counter()
  result = subprocess.run([sys.executable, '-c', _WRAP, sys.executable, *args], cwd=REPO, env=env,
                          capture_output=True, text=True)
  wall = time.perf_counter() - started
  if result.returncode:
    raise SystemExit(f'failed: {" ".join(args)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}')
  peak_kb = int(re.search(r'PEAK_RSS_KB (\d+)', result.stderr).group(1))
  if not dropped:
    print('note: page cache not dropped (not root): reads may be warm', file=sys.stderr)
  return result.stdout, result.stderr, wall, peak_kb * 1024 / _GB


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--dir', default='/tmp/hfimport')
  parser.add_argument('--layers', type=int, default=60)
  parser.add_argument('--shard_gb', type=float, default=1.0)
  parser.add_argument('--shard_mb', type=float, default=32.0,
                      help='offload.shard_mb: the embedding and head move in chunks of this size')
  parser.add_argument('--keep', action='store_true')
  args = parser.parse_args()
  root = pathlib.Path(args.dir)
  shutil.rmtree(root, ignore_errors=True)
  ckpt = root / 'hf'
  try:
    started = time.perf_counter()
    cfg = make_checkpoint(ckpt, args.layers, args.shard_gb)
    files = sorted(str(p) for p in ckpt.glob('*.safetensors'))
    size = sum(os.path.getsize(f) for f in files)
    print(f'checkpoint: {cfg.num_params:,} params, {size / _GB:.2f} GB in {len(files)} files '
          f'(written in {time.perf_counter() - started:.0f} s)', flush=True)
    env = dict(os.environ, MALLOC_ARENA_MAX='1', PYTHONPATH=str(REPO))
    out, _, base_wall, base_peak = run_measured(['-c', _BASELINE, *files], env)
    _, loaded, load_s = out.split()[-3:]
    train_args = [
        'launch.py', f'--config.init.from_hf={ckpt}', f'--workdir={root / "run"}',
        '--config.offload.params=nvme', '--config.offload.opt_state=nvme',
        '--config.offload.embed_head=nvme', '--config.offload.layers_per_group=1',
        '--config.offload.prefetch_depth=1', '--config.offload.activations=device',
        f'--config.offload.dir={root / "offload"}', f'--config.offload.shard_mb={args.shard_mb}',
        '--config.train.steps=1',
        '--config.train.seq_len=64', '--config.train.batch_size=1',
        '--config.train.microbatches=1', '--config.train.eval_batches=1',
        '--config.train.progress_bar=false', '--config.checkpoint.every=-1',
        f'--config.data.path={REPO.parent / "shared/data/wikitext-2/valid.txt"}']
    out, err, train_wall, train_peak = run_measured(train_args, env)
    match = re.search(r'([\d.,]+) GB of weights read into the planned tiers in ([\d.]+) s', out)
    imported, import_s = float(match.group(1).replace(',', '')), float(match.group(2))
    step = [line for line in out.splitlines() if line.startswith('step 1/1')]
    row = {'params': cfg.num_params, 'checkpoint_gb': size / _GB,
           'baseline_load_s': float(load_s), 'baseline_gbps': int(loaded) / _GB / float(load_s),
           'baseline_peak_rss_gb': base_peak, 'import_s': import_s,
           'import_gbps': imported / import_s, 'train_wall_s': train_wall,
           'train_peak_rss_gb': train_peak, 'step_line': step[0] if step else err[-500:]}
    print(f'\n{"":<28}{"seconds":>10}{"GB/s":>8}{"peak RSS GB":>13}')
    print(f'{"safetensors load_file":<28}{float(load_s):>10.1f}{row["baseline_gbps"]:>8.2f}'
          f'{base_peak:>13.2f}')
    print(f'{"init.from_hf -> NVMe":<28}{import_s:>10.1f}{row["import_gbps"]:>8.2f}'
          f'{train_peak:>13.2f}  (whole run: import + 1 step + eval, {train_wall:.0f} s wall)')
    print(row['step_line'])
    print(json.dumps(row))
  finally:
    if not args.keep:
      shutil.rmtree(root, ignore_errors=True)


if __name__ == '__main__':
  main()
