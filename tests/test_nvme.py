"""The NVMe tier: same numbers as the resident engine, corruption detected and named, read-after-
write ordering, bounded write-behind, offload.dir checks, bounded host memory."""

import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
import tensorstore as ts

from megatrain_jax import partition, train
from megatrain_jax.engine.streamed import StreamedEngine
from megatrain_jax.errors import ConfigError, StoreCorruptionError
from megatrain_jax.tiers import TransferStats
from megatrain_jax.tiers import codecs, nvme
from megatrain_jax.placement import Placement
from megatrain_jax.tiers.nvme import NvmeStore

from helpers import (AS_ROOT, CFG, assert_states_match, batches, config_with, initial_state,
                     make_tx, read_only_directory, read_rows, resident_run, small_config,
                     streamed_run, tmpfs)


@pytest.mark.parametrize('codec', ['none', 'zstd'])
@pytest.mark.parametrize('layers_per_group', [1, 2])
@pytest.mark.parametrize('num_micro', [1, 4])
@pytest.mark.parametrize('tiers', [('nvme', 'nvme'), ('nvme', 'host'), ('host', 'nvme')],
                         ids=['both-nvme', 'params-nvme', 'opt-nvme'])
def test_nvme_matches_resident(tmp_path, codec, layers_per_group, num_micro, tiers):
  want_losses, want_state = resident_run(num_micro, 1.0)
  engine, losses, state = streamed_run(
      num_micro, 1.0, params=tiers[0], opt_state=tiers[1], layers_per_group=layers_per_group,
      dir=str(tmp_path), codec=codec, shard_mb=0.004)  # several inner chunks per layer
  engine.close()
  np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
  assert_states_match(state, want_state)


@pytest.mark.parametrize('optimizer_on, grad_clip', [('host', 1.0), ('device', 0.0)])
def test_nvme_with_host_optimizer_and_without_clipping(tmp_path, optimizer_on, grad_clip):
  want_losses, want_state = resident_run(4, grad_clip)
  engine, losses, state = streamed_run(4, grad_clip, params='nvme', opt_state='nvme',
                                       layers_per_group=2, optimizer_on=optimizer_on,
                                       dir=str(tmp_path))
  engine.close()
  np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
  assert_states_match(state, want_state)


@pytest.mark.parametrize('tier', ['nvme', 'host'])
def test_host_optimizer_updates_band_by_band(tmp_path, tier):
  """Deferred host-optimizer updates cut into bands of one leaf each (a tiny shard_mb) equal the
  resident step: every band of a piece updates at the same step count, written once."""
  want_losses, want_state = resident_run(4, 1.0)
  engine, losses, state = streamed_run(4, 1.0, params=tier, opt_state=tier, embed_head=tier,
                                       layers_per_group=2, optimizer_on='host',
                                       dir=str(tmp_path), shard_mb=0.004)
  engine.close()
  layer_leaves = len(jax.tree.leaves(engine.params.get(0)))
  assert len(engine.updater.bands(0)) == layer_leaves > 1
  assert len(engine.updaters['embed'].bands(0)) == 1  # a vocabulary chunk is one leaf
  np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
  assert_states_match(state, want_state)


# ------------------------------------------------------------------------------------------------
# The store on its own.
# ------------------------------------------------------------------------------------------------

SLICES = [(0, 2), (2, 4)]


def group_tree(value: float, layers: int = 2):
  return {'layers': {'w': np.full((layers, 8, 16), value, np.float32),
                     'b': np.full((layers, 16), -value, np.float32)},
          'count': np.asarray(3, np.int32)}


def make_store(tmp_path, **kwargs):
  return NvmeStore('params', TransferStats(), directory=str(tmp_path), slices=SLICES,
                   shard_mb=kwargs.pop('shard_mb', 0.0002), **kwargs)


def test_round_trip_and_layout(tmp_path):
  store = make_store(tmp_path, codec='zstd')
  store.put(0, group_tree(1.0))
  store.put(1, group_tree(2.0))
  got = store.get(1)
  jax.tree.map(np.testing.assert_array_equal, got, group_tree(2.0))
  device = store.fetch(0).result()
  assert {x.sharding.memory_kind for x in jax.tree.leaves(device)} == {'device'}
  np.testing.assert_array_equal(device['layers']['w'], group_tree(1.0)['layers']['w'])
  # one file per layer per stacked leaf
  assert sorted(os.listdir(tmp_path / 'params' / 'layers.w' / 'c')) == ['0', '1', '2', '3']
  store.close()


def zeros_of(tree):
  """`tree` given by its leaves' shapes and dtypes: zeros for NvmeStore.put."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def stored_array(directory) -> np.ndarray:
  """A store's zarr3 array as it is on disk (every chunk must be there)."""
  spec = {'driver': 'zarr3', 'kvstore': {'driver': 'file', 'path': str(directory)},
          'fill_missing_data_reads': False}
  return ts.open(spec, open=True, read=True).result().read().result()


def test_zeros_are_registered_not_written(tmp_path):
  """Leaves put as ShapeDtypeStructs (AdamW's initial m and v) read as zeros with no disk read and
  no file; a put replaces them; a checkpoint's array_dirs writes what is still zero."""
  store = make_store(tmp_path)
  store.put(0, zeros_of(group_tree(0.0)))
  store.put(1, group_tree(2.0))
  store.flush()
  chunks = tmp_path / 'params' / 'layers.w' / 'c'
  assert sorted(os.listdir(chunks)) == ['2', '3']  # key 0's layers were never written
  read_before = store.stats.read_bytes
  got = store.get(0)
  jax.tree.map(np.testing.assert_array_equal, got, group_tree(0.0) | {'count': np.int32(0)})
  assert {x.dtype for x in jax.tree.leaves(got)} == {np.dtype(np.float32), np.dtype(np.int32)}
  assert store.stats.read_bytes == read_before  # nothing came from disk
  on_device = store.fetch(0).result()
  assert on_device['layers']['w'].sharding.memory_kind == 'device'
  np.testing.assert_array_equal(on_device['layers']['w'], 0.0)
  store.put(0, group_tree(3.0))  # the first update's write replaces the zeros
  np.testing.assert_array_equal(store.get(0)['layers']['b'], -3.0)
  store.put(1, zeros_of(group_tree(0.0)))  # zeros again over written layers: disk is stale
  np.testing.assert_array_equal(store.get(1)['layers']['w'], 0.0)
  dirs = store.array_dirs()
  np.testing.assert_array_equal(stored_array(dirs["['layers']['w']"]),
                                np.concatenate([np.full((2, 8, 16), 3.0), np.zeros((2, 8, 16))]))
  np.testing.assert_array_equal(store.get(1)['layers']['b'], 0.0)
  store.close()


def test_a_fresh_run_writes_no_adam_zeros_and_matches_resident(tmp_path):
  """init_state on NVMe writes the weights only (AdamW starts at zero: m and v are registered,
  not written) and then trains to the resident engine's numbers; a checkpoint of the untrained
  state links complete arrays."""
  tx, schedule, clip = make_tx(1.0)
  placement = Placement(params='nvme', opt_state='nvme', layers_per_group=2, dir=str(tmp_path))
  engine = StreamedEngine(CFG, tx, schedule, clip, placement, seed=0)
  for store in (engine.params, engine.opt_state):  # write-behind: the weights' writes may still run
    store.flush()
  layer_bytes = sum(x.nbytes for path, x in partition.by_path(initial_state()['params']).items()
                    if 'layers' in path)
  assert engine.stats.write_bytes == layer_bytes  # the weights; none of Adam's 2x as much
  assert not list((tmp_path / 'opt_state').rglob('c/*'))
  dirs = engine.checkpoint_pieces(1 << 20).disk  # a checkpoint now: Adam's files written first
  for path, directory in dirs.items():
    if path.startswith("['opt_state']"):
      np.testing.assert_array_equal(stored_array(directory), 0.0)
  engine.close()
  engine = StreamedEngine(CFG, tx, schedule, clip, placement, seed=0)
  losses = [float(engine.train_step(b)['learning/loss']) for b in batches(4)]
  state = engine.export_state()
  engine.close()
  want_losses, want_state = resident_run(4, 1.0)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
  assert_states_match(state, want_state)


class SlowWrites:
  """Delays every TensorStore write so that write-behind is observably behind."""

  def __init__(self, monkeypatch, store, seconds):
    self.in_flight = self.peak = 0
    self.lock = threading.Lock()
    original = store._write

    def slow_write(*args):
      with self.lock:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
      time.sleep(seconds)
      try:
        return original(*args)
      finally:
        with self.lock:
          self.in_flight -= 1

    monkeypatch.setattr(store, '_write', slow_write)


def test_a_read_sees_the_previous_write(tmp_path, monkeypatch):
  store = make_store(tmp_path)
  store.put(0, group_tree(1.0))
  store.flush()
  SlowWrites(monkeypatch, store, 0.3)
  store.put(0, group_tree(5.0))  # returns at once; the write lands 0.3 s later
  np.testing.assert_array_equal(store.fetch(0).result()['layers']['w'], 5.0)
  store.put(0, group_tree(7.0))
  np.testing.assert_array_equal(store.get(0)['layers']['b'], -7.0)
  store.close()


def test_write_behind_is_bounded(tmp_path, monkeypatch):
  store = make_store(tmp_path, max_pending_writes=1)
  slow = SlowWrites(monkeypatch, store, 0.2)
  started = time.perf_counter()
  for i in range(4):
    store.put(i % 2, group_tree(float(i)))
  queued = time.perf_counter() - started
  store.flush()
  assert queued >= 0.5  # put blocked while the single write slot was busy (3 waits of ~0.2 s)
  assert slow.peak == 1
  store.close()


@pytest.mark.parametrize('damage', ['flip', 'truncate', 'delete'])
def test_corruption_is_detected_and_named(tmp_path, damage):
  store = make_store(tmp_path)
  store.put(0, group_tree(1.0))
  store.put(1, group_tree(2.0))
  store.flush()
  path = codecs.chunk_file(str(tmp_path / 'params' / 'layers.w'), 3, 3)
  data = bytearray(pathlib.Path(path).read_bytes())
  if damage == 'flip':
    data[len(data) // 3] ^= 0x01
    pathlib.Path(path).write_bytes(bytes(data))
  elif damage == 'truncate':
    pathlib.Path(path).write_bytes(bytes(data[:len(data) // 2]))
  else:
    os.remove(path)
  np.testing.assert_array_equal(store.get(0)['layers']['w'], 1.0)  # the other group is fine
  with pytest.raises(StoreCorruptionError) as error:
    store.fetch(1).result()
  message = str(error.value)
  assert 'layers.w' in message and 'layer 3' in message and path in message, message
  store.close()


# A store over 2 devices: each layer's file is cut in two parts (one per device shard); the part
# damaged is the one named (the error named part 0 whichever part was bad).
_PARTS_SCRIPT = """
import pathlib, sys
import jax, numpy as np
from megatrain_jax.errors import StoreCorruptionError
from megatrain_jax.layout import Layout
from megatrain_jax.tiers import TransferStats, codecs
from megatrain_jax.tiers.nvme import NvmeStore
layout = Layout.for_devices(jax.devices()[:2])
store = NvmeStore('params', TransferStats(), layout, directory=sys.argv[1], slices=[(0, 2), (2, 4)])
store.put(0, {'layers': {'w': np.full((2, 8, 16), 1.0, np.float32)}})
store.put(1, {'layers': {'w': np.full((2, 8, 16), 2.0, np.float32)}})
store.flush()
axis = layout.parts((4, 8, 16), "['layers']['w']")[0]
leaf = str(pathlib.Path(sys.argv[1]) / 'params' / 'layers.w')
bad, part_0 = (codecs.chunk_file(leaf, 3, 3, 0, (axis, j)) for j in (1, 0))
assert axis == 1 and bad != part_0, (axis, bad)
data = bytearray(pathlib.Path(bad).read_bytes())
data[len(data) // 3] ^= 1
pathlib.Path(bad).write_bytes(bytes(data))
try:
  store.fetch(1).result()
except StoreCorruptionError as error:
  print('named:', f'file {bad} ' in str(error), 'part 0 named:', f'file {part_0} ' in str(error))
store.close()
"""


def test_corruption_of_a_device_part_names_that_part(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS='--xla_force_host_platform_device_count=2')
  done = subprocess.run([sys.executable, '-c', _PARTS_SCRIPT, str(tmp_path)], env=env,
                        capture_output=True, text=True, timeout=300, check=False)
  assert done.stdout.strip() == 'named: True part 0 named: False', done.stdout + done.stderr


def test_a_store_killed_half_deleted_is_finished_by_the_next_start(tmp_path, monkeypatch):
  """A run replaces its live stores at start; shutil.rmtree deletes each array's zarr.json before
  its chunks, and a kill in between (a preemption during start-up) left chunks without metadata:
  every later start refused the directory as a user's. Renamed before it is deleted, a store
  killed half deleted is the next start's to finish."""
  store = make_store(tmp_path)
  store.put(0, group_tree(1.0))
  store.flush()
  store.close()

  def killed_after_the_metadata(directory, ignore_errors=False):
    del ignore_errors
    for meta in pathlib.Path(directory).glob('*/zarr.json'):
      meta.unlink()
    raise KeyboardInterrupt  # as a kill: nothing after it runs

  monkeypatch.setattr(nvme.shutil, 'rmtree', killed_after_the_metadata)
  with pytest.raises(KeyboardInterrupt):
    make_store(tmp_path)
  monkeypatch.undo()
  assert nvme.not_stores(str(tmp_path)) == []  # nothing under a store's name to refuse
  [half] = nvme.store_dirs(str(tmp_path))  # counted as the run's disk
  assert half.name.startswith('.deleting-params-') and list(half.glob('*/c/*'))
  store = make_store(tmp_path)
  nvme.remove_other_stores(str(tmp_path), {'params'})
  assert sorted(p.name for p in tmp_path.iterdir()) == ['params']
  store.put(0, group_tree(3.0))
  np.testing.assert_array_equal(store.get(0)['layers']['w'], 3.0)
  store.close()


# ------------------------------------------------------------------------------------------------
# offload.dir checks, before anything is written.
# ------------------------------------------------------------------------------------------------

NVME = dict(offload__params='nvme', offload__opt_state='nvme')


def test_offload_dir_not_writable(tmp_path):
  with read_only_directory() as locked:
    with pytest.raises(ConfigError, match=r'offload.dir=.*not a writable directory'):
      train.train_and_evaluate(config_with(offload__dir=str(locked / 'stores'), **NVME),
                               str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()


@AS_ROOT
def test_too_little_free_space_is_refused_with_needed_and_available(tmp_path):
  # tiny config: 4 layers x 0.73M params x 12 bytes = 35 MB of NVMe state; the disk has 8 MB.
  with tmpfs(8) as disk:
    config = config_with(offload__dir=str(disk / 'stores'), **NVME)
    with pytest.raises(ConfigError, match=r'need 69\.65 MB') as error:  # 2 x: a snapshot
      train.train_and_evaluate(config, str(tmp_path / 'run'))
    assert 'free there' in str(error.value)
    assert os.listdir(disk) == []
  assert not (tmp_path / 'run').exists()


# ------------------------------------------------------------------------------------------------
# Through the trainer, and bounded host memory.
# ------------------------------------------------------------------------------------------------

def test_trainer_runs_the_nvme_tier_and_reports_io(tmp_path, shared_data):
  config = small_config(shared_data / 'tinyshakespeare' / 'input.txt', train__steps=4,
                        checkpoint__every=0, offload__codec='zstd', **NVME)
  train.train_and_evaluate(config, str(tmp_path))
  rows = [r for r in read_rows(tmp_path) if 'learning/loss' in r]
  assert len(rows) == 4
  for row in rows[1:]:
    assert row['io/read_gb'] > 0 and row['io/read_gbps'] > 0 and row['io/write_gbps'] > 0
    assert 1.0 < row['io/compression_ratio'] < 2.0  # zstd on FP32: a little, never a lot
    assert row['perf/fetch_wait_s'] >= 0
  assert (tmp_path / 'offload' / 'params').is_dir()


RSS_SCRIPT = '''
import json, resource, sys
import jax, numpy as np
from megatrain_jax import optim
from megatrain_jax.engine.streamed import StreamedEngine
from megatrain_jax.model import ModelConfig
from megatrain_jax.placement import Placement
import types
layers, workdir = int(sys.argv[1]), sys.argv[2]
cfg = ModelConfig(vocab_size=256, d_model=512, num_layers=layers, num_heads=8, num_kv_heads=4,
                  d_ff=2048, max_seq_len=64)
train = types.SimpleNamespace(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
                              warmup_steps=1, steps=10, min_lr_ratio=0.1)
placement = Placement(params='nvme', opt_state='nvme', layers_per_group=1, dir=workdir,
                      host_buffer_gb=0.15)  # room for 3 groups in flight: the minimum
engine = StreamedEngine(cfg, optim.make_optimizer(train), optim.lr_schedule(train), float(sys.argv[3]),
                        placement, seed=0)
batch = np.random.default_rng(0).integers(0, 256, (1, 2, 33)).astype(np.int32)
for _ in range(3):
  float(engine.train_step(batch)['learning/loss'])
engine.close()
print(json.dumps({'peak_rss_bytes': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  'group_bytes': 16 * cfg.params_per_layer}))
'''


def test_host_memory_does_not_grow_with_depth(tmp_path):
  """Peak RSS with 2x the layers grows by less than one group (weights + grads + Adam m, v)."""
  results = {}
  for layers in (6, 12):
    out = subprocess.run([sys.executable, '-c', RSS_SCRIPT, str(layers), str(tmp_path / str(layers)),
                          '1.0'],  # exact clipping: parked gradients must not pile up in RAM
                         capture_output=True, text=True, timeout=600,
                         # one malloc arena: freed staging buffers are reused, not left behind in
                         # per-thread arenas (RSS then measures what the engine holds)
                         env=dict(os.environ, JAX_PLATFORMS='cpu', MALLOC_ARENA_MAX='1'))
    assert out.returncode == 0, out.stderr[-3000:]
    results[layers] = json.loads(out.stdout.strip().splitlines()[-1])
  growth = results[12]['peak_rss_bytes'] - results[6]['peak_rss_bytes']
  group = results[6]['group_bytes']
  # 6 more layers held in RAM would add 6 groups; streaming from disk must add less than one.
  assert growth < group, (growth, group, results)
