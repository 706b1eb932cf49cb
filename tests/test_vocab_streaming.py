"""The embedding and LM head stream in vocabulary chunks (issue 10): the streamed engine keeps them
in chunks of at most offload.shard_mb in any tier (device, host, nvme), runs the head's loss chunk
by chunk with an online logsumexp, and still trains to the resident engine's numbers; tied and
untied heads, device and host optimizers."""

import dataclasses

import jax
import numpy as np
import pytest

from megatrain_jax import train
from megatrain_jax.checkpoint import Checkpointer
from megatrain_jax.engine import resident
from megatrain_jax.engine.streamed import StreamedEngine
from megatrain_jax.errors import ConfigError
from megatrain_jax.placement import Placement

from helpers import CFG, assert_states_match, batches, config_with, make_tx, read_only_directory

TIED = dataclasses.replace(CFG, tie_embeddings=True)
SHARD_MB = 0.004  # 4 KB: vocabulary chunks of 32 rows of d_model 32 -> 97 ids in 4 chunks


def _runs(cfg, placement: Placement, num_micro: int = 2, grad_clip: float = 1.0):
  """(resident losses and state, streamed engine, its losses and state) over the same batches."""
  tx, schedule, clip = make_tx(grad_clip)
  state = jax.tree.map(np.asarray, jax.jit(resident.init_state, static_argnums=(0, 1))(cfg, tx, 0))
  res = resident.ResidentEngine(cfg, tx, schedule, clip, jax.tree.map(np.copy, state))
  want = [float(res.train_step(b)['learning/loss']) for b in batches(num_micro)]
  placement.check(cfg)
  engine = StreamedEngine(cfg, tx, schedule, clip, placement, jax.tree.map(np.copy, state))
  got = [float(engine.train_step(b)['learning/loss']) for b in batches(num_micro)]
  streamed_state = engine.export_state()
  engine.close()
  return want, jax.tree.map(np.asarray, res.export_state()), engine, got, streamed_state


@pytest.mark.parametrize('cfg', [CFG, TIED], ids=['untied', 'tied'])
@pytest.mark.parametrize('embed_head, optimizer_on', [
    ('device', 'device'), ('host', 'device'), ('nvme', 'device'), ('nvme', 'host')])
def test_vocabulary_chunks_train_like_the_resident_engine(tmp_path, cfg, embed_head, optimizer_on):
  placement = Placement(params='host', opt_state='host', embed_head=embed_head,
                        optimizer_on=optimizer_on, layers_per_group=1, shard_mb=SHARD_MB,
                        dir=str(tmp_path))
  want, want_state, engine, got, state = _runs(cfg, placement)
  assert engine.vocab == [(0, 32), (32, 64), (64, 96), (96, 97)]
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert_states_match(state, want_state)


def test_each_vocabulary_chunk_crosses_to_the_device_as_the_schedule_says(tmp_path):
  """Embedding chunks: once for the embedding, again for the update (+ parked gradient); head
  chunks twice for the loss (forward, backward) and once more for the update."""
  placement = Placement(params='host', opt_state='host', embed_head='host', shard_mb=SHARD_MB,
                        dir=str(tmp_path))
  _, _, engine, _, _ = _runs(CFG, placement, num_micro=1)
  fetches = engine.stats.fetches  # of the last step
  for c in range(4):
    assert fetches[('embed_params', c)] == 2 and fetches[('embed_grads', c)] == 1
    assert fetches[('head_params', c)] == 3 and fetches[('head_opt', c)] == 1


def test_head_logits_never_exist_whole():
  """The head stage's jitted functions see one vocabulary chunk: no [B, S, V] array in them."""
  tx, schedule, clip = make_tx(1.0)
  cfg = dataclasses.replace(CFG, vocab_size=4096)
  placement = Placement(params='host', opt_state='host', embed_head='host', shard_mb=0.0625)
  engine = StreamedEngine(cfg, tx, schedule, clip, placement, seed=0)
  assert len(engine.vocab) == 8  # 512 rows per chunk
  batch = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 2, 17)).astype(np.int32)
  engine.train_step(batch)
  piece = engine.stores['head'].params.fetch(0)  # its device copy
  normed = np.zeros((2, 16, cfg.d_model), np.float32)
  targets = np.zeros((2, 16), np.int32)
  jaxpr = jax.make_jaxpr(engine.fn.head_chunk_backward)(
      piece, normed, targets, np.int32(0), np.zeros(32, np.float32), None, None)
  shapes = {tuple(v.aval.shape) for eqn in jaxpr.jaxpr.eqns for v in eqn.outvars}
  assert all(cfg.vocab_size not in shape for shape in shapes), shapes
  engine.close()


def test_embedding_on_nvme_needs_a_writable_offload_dir(tmp_path):
  """offload.embed_head=nvme alone (layers in memory) checks offload.dir like the layer tiers do,
  before anything is written."""
  with read_only_directory() as locked:
    config = config_with(offload__dir=str(locked / 'stores'), offload__params='host',
                         offload__opt_state='host', offload__embed_head='nvme')
    with pytest.raises(ConfigError, match=r'offload.dir=.*not a writable directory'):
      train.train_and_evaluate(config, str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize('embed_head', ['host', 'nvme'])
def test_vocabulary_chunks_checkpoint_and_restore_in_any_engine(tmp_path, embed_head):
  """A checkpoint of chunked embedding/head pieces (the head kernel cut on its vocabulary axis)
  restores bitwise into another streamed engine and into the resident engine."""
  placement = Placement(params='host', opt_state='nvme', embed_head=embed_head, shard_mb=SHARD_MB,
                        dir=str(tmp_path / 'offload'))
  tx, schedule, clip = make_tx(1.0)
  engine = StreamedEngine(CFG, tx, schedule, clip, placement, seed=0)
  engine.train_step(batches(1)[0])
  want = engine.export_state()
  checkpointer = Checkpointer(tmp_path / 'run', keep=1)
  checkpointer.save(1, engine, data_position=0, model_cfg=CFG, placement=placement)
  checkpointer.close()
  engine.close()
  reader = Checkpointer(tmp_path / 'run', keep=1).restore(CFG)
  again = StreamedEngine(CFG, tx, schedule, clip, dataclasses.replace(
      placement, dir=str(tmp_path / 'offload2')), restore_from=reader)
  jax.tree.map(np.testing.assert_array_equal, again.export_state(), want)
  again.close()
  state = reader.device_state(resident.abstract_state(CFG, tx))
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state), want)
