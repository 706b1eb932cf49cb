"""What model.document_mask costs a training step, measured side by side in one process.

    python bench/document_mask.py [--rounds 10] [--seq 256] [--docs 8]

The model of bench/streamed_vs_resident.py (6 layers, d_model 384, 2 microbatches of 4 x 256
tokens) takes resident steps on the same batch with and without the mask, alternating
(ABAB...): the batch has an EOS (id 0) every seq/docs tokens on average, at random places. The
mask's work is a comparison per attention score and the positions of each microbatch (a cumsum
over [B, S]); the ratio is the median over rounds of masked / plain step time. With
--streamed the same for the streamed engine (K = 1, weights and Adam in host memory), whose
microbatches then get positions of their own.
"""

import argparse
import platform
import statistics
import time

import jax
import numpy as np

from megatrain_jax import config as config_lib
from megatrain_jax import optim
from megatrain_jax.engine import resident
from megatrain_jax.engine.streamed import StreamedEngine
from megatrain_jax.placement import Placement

from streamed_vs_resident import BATCH, MICROBATCHES, MODEL  # pylint: disable=wrong-import-order


def _engine(cfg, tx, schedule, state, streamed: bool):
  if streamed:
    return StreamedEngine(cfg, tx, schedule, 1.0, Placement(params='host', opt_state='host',
                                                            layers_per_group=1), state)
  return resident.ResidentEngine(cfg, tx, schedule, 1.0, jax.tree.map(np.copy, state))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--rounds', type=int, default=10)
  parser.add_argument('--seq', type=int, default=256)
  parser.add_argument('--docs', type=int, default=8, help='documents per row, on average')
  parser.add_argument('--streamed', action='store_true')
  args = parser.parse_args()

  cfg = MODEL.replace(max_seq_len=max(MODEL.max_seq_len, args.seq))
  train_cfg = config_lib.load_config('tiny', train__steps=1000).train
  tx, schedule = optim.make_optimizer(train_cfg), optim.lr_schedule(train_cfg)
  state = jax.tree.map(np.asarray, jax.jit(resident.init_state, static_argnums=(0, 1))(cfg, tx, 0))
  rng = np.random.default_rng(0)
  batch = rng.integers(1, cfg.vocab_size, (MICROBATCHES, BATCH, args.seq + 1)).astype(np.int32)
  batch[rng.random(batch.shape) < args.docs / args.seq] = 0
  engines = {'plain': _engine(cfg, tx, schedule, state, args.streamed),
             'masked': _engine(cfg.replace(document_eos_id=0), tx, schedule, state, args.streamed)}
  losses = {name: float(e.train_step(batch)['learning/loss']) for name, e in engines.items()}
  times = {name: [] for name in engines}
  for r in range(args.rounds):
    for name in (('plain', 'masked') if r % 2 == 0 else ('masked', 'plain')):
      started = time.perf_counter()
      float(engines[name].train_step(batch)['learning/loss'])
      times[name].append(time.perf_counter() - started)
  ratios = [m / p for m, p in zip(times['masked'], times['plain'])]
  print(f'machine: {platform.node()} {platform.machine()}, {jax.default_backend()}, '
        f'jax {jax.__version__}; {"streamed K=1" if args.streamed else "resident"} engine')
  print(f'{MICROBATCHES} x {BATCH} x {args.seq} tokens/step, ~{args.docs} documents per row; '
        f'first-step loss plain {losses["plain"]:.4f}, masked {losses["masked"]:.4f}')
  for name in engines:
    print(f'{name}: median step {statistics.median(times[name]):.3f} s')
  quartiles = statistics.quantiles(ratios, n=4)
  print(f'masked / plain: {statistics.median(ratios):.3f} '
        f'(quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f}, {args.rounds} rounds)')


if __name__ == '__main__':
  main()
