"""Checkpoint cost of an NVMe run: hard-link snapshot (checkpoint.py) vs gathering the state into
RAM for an orbax save (what checkpoints did before), and the restore paths.

  PYTHONPATH=. python bench/checkpoint_snapshot.py --layers 8 --d_model 1024 --d_ff 4096 --dir /tmp/ckpt_bench

Prints one JSON line: NVMe state bytes, seconds and peak-RSS growth of each path.
"""

import argparse
import json
import pathlib
import resource
import shutil
import time
import types

import orbax.checkpoint as ocp

from megatrain_jax import optim
from megatrain_jax.checkpoint import Checkpointer
from megatrain_jax.engine import resident
from megatrain_jax.engine.streamed import StreamedEngine
from megatrain_jax.model import ModelConfig
from megatrain_jax.placement import Placement


def rss_bytes() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--layers', type=int, default=8)
  parser.add_argument('--d_model', type=int, default=1024)
  parser.add_argument('--d_ff', type=int, default=4096)
  parser.add_argument('--dir', default='/tmp/ckpt_bench')
  args = parser.parse_args()
  root = pathlib.Path(args.dir)
  shutil.rmtree(root, ignore_errors=True)
  cfg = ModelConfig(vocab_size=256, d_model=args.d_model, num_layers=args.layers,
                    num_heads=args.d_model // 64, num_kv_heads=args.d_model // 128,
                    d_ff=args.d_ff, max_seq_len=64)
  train = types.SimpleNamespace(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
                                warmup_steps=1, steps=10, min_lr_ratio=0.1)
  tx = optim.make_optimizer(train)
  placement = Placement(params='nvme', opt_state='nvme', layers_per_group=1,
                        dir=str(root / 'offload'), host_buffer_gb=4)
  engine = StreamedEngine(cfg, tx, optim.lr_schedule(train), 1.0, placement, seed=0)
  engine.params.flush()
  engine.opt_state.flush()
  nvme_bytes = 12 * cfg.num_layers * cfg.params_per_layer
  out = {'params': cfg.num_params, 'nvme_state_gb': nvme_bytes / 1e9}

  checkpointer = Checkpointer(root / 'run', keep=2)
  rss0, t0 = rss_bytes(), time.perf_counter()
  checkpointer.save(1, engine, data_position=0, model_cfg=cfg)
  t1 = time.perf_counter()
  checkpointer.wait()
  t2 = time.perf_counter()
  out.update(snapshot_blocking_s=t1 - t0, snapshot_committed_s=t2 - t0,
             snapshot_rss_growth_gb=(rss_bytes() - rss0) / 1e9)

  t0 = time.perf_counter()
  reader = checkpointer.restore(cfg)
  t1 = time.perf_counter()
  engine.close()
  target = StreamedEngine(cfg, tx, optim.lr_schedule(train), 1.0, placement, restore_from=reader)
  target.close()
  t2 = time.perf_counter()
  out.update(restore_verify_s=t1 - t0, restore_link_s=t2 - t1)

  # The old way: the whole state gathered in RAM, then an orbax save of it.
  engine = StreamedEngine(cfg, tx, optim.lr_schedule(train), 1.0, placement, restore_from=reader)
  rss0, t0 = rss_bytes(), time.perf_counter()
  state = engine.export_state()
  t1 = time.perf_counter()
  saver = ocp.StandardCheckpointer()
  saver.save(root / 'orbax', state)
  saver.wait_until_finished()
  t2 = time.perf_counter()
  out.update(gather_s=t1 - t0, orbax_save_s=t2 - t1, gather_and_orbax_s=t2 - t0,
             gather_rss_growth_gb=(rss_bytes() - rss0) / 1e9)
  del state
  t0 = time.perf_counter()
  full = reader.full_state(resident.abstract_state(cfg, tx))
  out['restore_full_state_layer_by_layer_s'] = time.perf_counter() - t0
  del full
  engine.close()
  print(json.dumps(out))


if __name__ == '__main__':
  main()
