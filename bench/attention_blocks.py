"""Query blocks that skip masked keys vs query blocks against all keys, side by side in one process.

    python bench/attention_blocks.py [--seqs 2048,8192] [--window 0,1024] [--rounds 5] [--json F]

One decoder layer's forward + backward (jax.value_and_grad of model.apply_layer, remat none,
float32, batch 1), at each sequence length and sliding window, in blocks of
model.attention_chunk = 512 queries computed two ways:
- 'bands' (the layers since 2026-12-07): each block scored only against the keys a query of it may
  see (ModelConfig.attention_bands: causality, and the window);
- 'all keys' (before): every block scored against all S keys, then masked. The bench gets it by
  making attention_bands return one band of everything, which is what layers._attend_blocks ran.
Each round times one step of each, alternating which goes first (this VM's speed drifts); the
ratio is the median over rounds of bands / all keys of that round. Compilation is excluded and
reported apart. Also printed: the FLOPs each program multiplies (ModelConfig.layer_forward_flops,
what the planner prices; test_model.py checks the keys each band's program scores) and XLA's
temporary bytes of the compiled step (memory_analysis), the scores of the largest block.
"""

import argparse
import json
import statistics
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax import model as model_lib
from megatrain_jax.model import ModelConfig


def _layer_step(cfg, seq):
  """A jitted value_and_grad of one layer's summed output, its params and input."""
  params = jax.tree.map(lambda a: a[0], model_lib.init_layers(cfg, jax.random.key(0), 0, 1))
  x = jax.random.normal(jax.random.key(1), (1, seq, cfg.d_model), jnp.float32)
  positions = model_lib.default_positions(jnp.zeros((1, seq), jnp.int32))

  def loss(p, h):
    return jnp.sum(model_lib.apply_layer(cfg, p, h, positions) ** 2)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), params, x


def _compiled(cfg, seq, all_keys: bool):
  """(compiled step, args, compile seconds, temp bytes), the bands' way or every key's."""
  patch = (mock.patch.object(ModelConfig, 'attention_bands', lambda self, s: ((0, s, 0, s),))
           if all_keys else mock.patch.object(ModelConfig, 'attention_bands',
                                              ModelConfig.attention_bands))
  with patch:
    step, params, x = _layer_step(cfg, seq)
    start = time.perf_counter()
    compiled = step.lower(params, x).compile()
    seconds = time.perf_counter() - start
  jax.block_until_ready(compiled(params, x))  # the first run, excluded
  return compiled, (params, x), seconds, compiled.memory_analysis().temp_size_in_bytes


def _time(compiled, args) -> float:
  start = time.perf_counter()
  jax.block_until_ready(compiled(*args))
  return time.perf_counter() - start


def measure(seq: int, window: int, rounds: int) -> dict:
  cfg = ModelConfig(vocab_size=256, d_model=512, num_layers=1, num_heads=8, num_kv_heads=8,
                    d_ff=1376, max_seq_len=seq, attention_chunk=512, sliding_window=window,
                    remat='none')
  runs = {name: _compiled(cfg, seq, all_keys) for name, all_keys in
          (('bands', False), ('all keys', True))}
  times = {name: [] for name in runs}
  ratios = []
  for r in range(rounds):
    order = ('bands', 'all keys') if r % 2 == 0 else ('all keys', 'bands')
    for name in order:
      times[name].append(_time(runs[name][0], runs[name][1]))
    ratios.append(times['bands'][-1] / times['all keys'][-1])
  whole = cfg.replace(attention_chunk=0)
  return {
      'seq': seq, 'window': window, 'bands': len(cfg.attention_bands(seq)),
      'step_s': {name: statistics.median(t) for name, t in times.items()},
      'ratio': statistics.median(ratios), 'ratios': ratios,
      'compile_s': {name: run[2] for name, run in runs.items()},
      'temp_gb': {name: run[3] / 1e9 for name, run in runs.items()},
      'forward_gflop': {'bands': seq * cfg.layer_forward_flops(seq) / 1e9,
                        'all keys': seq * whole.layer_forward_flops(seq) / 1e9},
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--seqs', default='2048,8192')
  parser.add_argument('--window', default='0,1024', help='sliding windows (0 = none)')
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--json', default='')
  args = parser.parse_args()
  rows = []
  print('| S | window | bands | forward GFLOP (bands / all keys) | step s (bands / all keys) | '
        'ratio [min, max] | compile s (bands / all keys) | XLA temp GB (bands / all keys) |')
  print('|---:|---:|---:|---|---|---|---|---|')
  for seq in (int(s) for s in args.seqs.split(',')):
    for window in (int(w) for w in args.window.split(',')):
      row = measure(seq, window, args.rounds)
      rows.append(row)
      pair = lambda d, f: f'{d["bands"]:{f}} / {d["all keys"]:{f}}'  # noqa: E731
      print(f'| {seq} | {window or "-"} | {row["bands"]} | {pair(row["forward_gflop"], ".1f")} | '
            f'{pair(row["step_s"], ".3f")} | **{row["ratio"]:.2f}** [{np.min(row["ratios"]):.2f}, '
            f'{np.max(row["ratios"]):.2f}] | {pair(row["compile_s"], ".1f")} | '
            f'{pair(row["temp_gb"], ".2f")} |', flush=True)
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump({'device': jax.devices()[0].device_kind, 'rows': rows}, f, indent=1)


if __name__ == '__main__':
  main()
