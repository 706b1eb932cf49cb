"""The streamed engine reproduces the resident engine: same loss at every step and params within
float32 rounding after 5 steps, for every group size, microbatch count, clipping, optimizer and
activation placement; each group's weights cross to the device exactly twice per step; leaves keep
their memory kinds; checkpoints move between engines."""

import itertools

import jax
import numpy as np
import pytest

from megatrain_jax import data as data_lib
from megatrain_jax import partition, train
from megatrain_jax.data import Batch
from megatrain_jax.engine import resident
from megatrain_jax.engine.streamed import StreamedEngine
from megatrain_jax.errors import ConfigError
from megatrain_jax.placement import Placement

from helpers import (CFG, DOCUMENTS_CFG, assert_states_match, batches, initial_state, make_tx,
                     read_rows, resident_run, run_until_crash, small_config, streamed_run,
                     with_documents)


# K = 1, 2 (even split), 3 (a remainder group of 1), 4 (all layers) over 4 layers.
GROUP_SIZES = (1, 2, 3, 4)


@pytest.mark.parametrize('layers_per_group, num_micro, grad_clip, optimizer_on',
                         itertools.product(GROUP_SIZES, (1, 4), (1.0, 0.0), ('device', 'host')))
def test_streamed_matches_resident(layers_per_group, num_micro, grad_clip, optimizer_on):
  want_losses, want_state = resident_run(num_micro, grad_clip)
  _, losses, state = streamed_run(num_micro, grad_clip, layers_per_group=layers_per_group,
                                  optimizer_on=optimizer_on,
                                  activations='host' if layers_per_group % 2 else 'device')
  np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
  assert_states_match(state, want_state)


@pytest.mark.parametrize('layers_per_group, num_micro, activations, optimizer_on', [
    (2, 1, 'device', 'device'),
    (2, 4, 'host', 'device'),
    (3, 4, 'device', 'host'),  # groups of 3 and 1
    (3, 1, 'host', 'device'),
])
def test_kept_layer_inputs_match_resident(layers_per_group, num_micro, activations, optimizer_on):
  """offload.keep_layer_inputs: the backward from every layer's saved input (each layer
  recomputed once, remat off) gives the resident engine's numbers, whatever the activations'
  tier."""
  want_losses, want_state = resident_run(num_micro, 1.0)
  engine, losses, state = streamed_run(num_micro, 1.0, layers_per_group=layers_per_group,
                                       activations=activations, optimizer_on=optimizer_on,
                                       keep_layer_inputs=True)
  assert engine.placement.keeps_layer_inputs
  np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
  assert_states_match(state, want_state)


@pytest.mark.parametrize('placement', [
    dict(params='device', opt_state='host'),
    dict(params='host', opt_state='device'),
    dict(params='device', opt_state='device', activations='host'),
    dict(params='device', opt_state='device', embed_head='host'),
    dict(params='host', opt_state='host', embed_head='host', activations='host', prefetch_depth=3),
])
def test_tiers_apart_and_together_match_resident(placement):
  want_losses, want_state = resident_run(4, 1.0)
  _, losses, state = streamed_run(4, 1.0, layers_per_group=2, **placement)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
  assert_states_match(state, want_state)


@pytest.mark.parametrize('placement', [
    dict(layers_per_group=1, num_micro=1),
    dict(layers_per_group=3, num_micro=4, activations='host'),
    dict(layers_per_group=2, num_micro=4, params='nvme', opt_state='nvme'),
])
def test_gradients_parked_on_the_device_match_resident(tmp_path, placement):
  """offload.park_grads='device': a deferred device update reads its gradient from device memory
  (no round trip through the host tier) and gives the resident engine's numbers; the parked
  gradients live on the device and are freed once their update has read them."""
  num_micro = placement.pop('num_micro')
  want_losses, want_state = resident_run(num_micro, 1.0)
  engine, losses, state = streamed_run(num_micro, 1.0, park_grads='device', dir=str(tmp_path),
                                       **{'params': 'host', 'opt_state': 'host', **placement})
  assert engine.parked_grads.tier == 'device'
  for g in range(len(engine.slices)):  # every group's gradient spent and freed
    with pytest.raises(KeyError):
      engine.parked_grads.get(g)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
  assert_states_match(state, want_state)


@pytest.mark.parametrize('num_micro', [1, 8])
@pytest.mark.parametrize('grad_clip, optimizer_on', [
    (0.0, 'device'),  # forward + backward; the update reuses the backward's copy
    (1.0, 'host'),  # the host optimizer updates the weights where they live
    # exact clipping on the device: the update waits for the next forward, whose fetch it shares
    (1.0, 'device'),
])
def test_each_group_crosses_to_the_device_twice(num_micro, grad_clip, optimizer_on):
  """Per step (the last of 3: a clipped step's updates run in the next one's forward), each
  group's weights are fetched twice, and its Adam state once by the device optimizer, never by
  the host one."""
  tx, schedule, clip = make_tx(grad_clip)
  placement = Placement(params='host', opt_state='host', layers_per_group=1,
                        optimizer_on=optimizer_on)
  engine = StreamedEngine(CFG, tx, schedule, clip, placement,
                          jax.tree.map(np.copy, initial_state()))
  for batch in batches(num_micro)[:3]:
    engine.train_step(batch)
  num_groups = CFG.num_layers
  assert {g: engine.stats.fetches[('params', g)] for g in range(num_groups)} == {
      g: 2 for g in range(num_groups)}
  opt_fetches = 0 if optimizer_on == 'host' else 1
  assert all(engine.stats.fetches[('opt_state', g)] == opt_fetches for g in range(num_groups))
  # and the bytes: weights in twice; new weights and Adam state out once (device optimizer)
  group_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.params.get(0)))
  assert engine.stats.h2d_bytes >= 2 * num_groups * group_bytes
  engine.close()


@pytest.mark.parametrize('placement, kinds', [
    (dict(params='host', opt_state='host'), ('pinned_host', 'pinned_host', 'device')),
    (dict(params='device', opt_state='host', embed_head='host'),
     ('device', 'pinned_host', 'pinned_host')),
])
def test_leaves_keep_their_memory_kinds(placement, kinds):
  engine, _, _ = streamed_run(1, 1.0, layers_per_group=2, **placement)
  params_kind, opt_kind, outer_kind = kinds
  for g in range(2):
    assert {x.sharding.memory_kind for x in jax.tree.leaves(engine.params.get(g))} == {params_kind}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(engine.opt_state.get(g))} == {opt_kind}
  outer = [store.get(key) for kind in ('embed', 'head', 'final_norm')
           for store in (engine.stores[kind].params, engine.stores[kind].opt_state)
           for key in range(len(engine.kind_slices[kind]))]
  assert {x.sharding.memory_kind for x in jax.tree.leaves(outer)} == {outer_kind}


def test_streamed_init_equals_resident_init():
  tx, schedule, clip = make_tx(1.0)
  engine = StreamedEngine(CFG, tx, schedule, clip, Placement(params='host', opt_state='host',
                                                             layers_per_group=3), seed=0)
  got, want = engine.export_state(), initial_state()
  jax.tree.map(np.testing.assert_array_equal, got['params'], want['params'])
  jax.tree.map(np.testing.assert_array_equal, got['opt_state'], want['opt_state'])
  np.testing.assert_array_equal(got['rng'], want['rng'])


def test_streamed_eval_matches_resident():
  tx, schedule, clip = make_tx(1.0)
  state = initial_state()
  evals = [b[0] for b in batches(1)[:3]]
  res = resident.ResidentEngine(CFG, tx, schedule, clip, jax.tree.map(np.copy, state))
  streamed = StreamedEngine(CFG, tx, schedule, clip, Placement(params='host', opt_state='host',
                                                               layers_per_group=3), state)
  np.testing.assert_allclose(streamed.eval_losses(evals), res.eval_losses(evals), rtol=1e-6)


@pytest.mark.parametrize('placement', [
    dict(params='host', opt_state='host'),
    dict(params='host', opt_state='host', optimizer_on='host'),
    dict(params='nvme', opt_state='nvme', optimizer_on='host', shard_mb=0.004),  # in bands
    dict(params='nvme', opt_state='host', park_grads='device', layers_per_group=2),
])
def test_updates_waiting_for_the_next_forward_reach_every_reader(tmp_path, placement):
  """With exact clipping a step's layer updates wait for the next forward. An evaluation's
  forward runs them (its losses are the resident engine's after the step), the next step's
  forward does not run them twice, and an export flushes what still waits."""
  tx, schedule, clip = make_tx(1.0)
  evals = [b[0] for b in batches(1)[:2]]
  steps = batches(4)[:2]
  res = resident.ResidentEngine(CFG, tx, schedule, clip, jax.tree.map(np.copy, initial_state()))
  placement = Placement(**{'layers_per_group': 1, 'dir': str(tmp_path), **placement})
  placement.check(CFG)
  streamed = StreamedEngine(CFG, tx, schedule, clip, placement,
                            jax.tree.map(np.copy, initial_state()))
  want, got = res.train_step(steps[0]), streamed.train_step(steps[0])
  # Deferred: the stores still hold the initial weights until a forward (or a flush) runs them.
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, streamed.params.get(0)),
               partition.piece_of(initial_state()['params'], 'layers', *streamed.slices[0]))
  np.testing.assert_allclose(streamed.eval_losses(evals), res.eval_losses(evals), rtol=1e-6)
  np.testing.assert_allclose(streamed.eval_losses(evals), res.eval_losses(evals), rtol=1e-6)
  want, got = res.train_step(steps[1]), streamed.train_step(steps[1])
  np.testing.assert_allclose(float(got['learning/loss']), float(want['learning/loss']), rtol=1e-6)
  assert_states_match(streamed.export_state(), jax.tree.map(np.asarray, res.export_state()), 2)
  streamed.close()


@pytest.mark.parametrize('field, value, message', [
    ('params', 'disk', "offload.params='disk' is not a tier for it: use one of device, host, nvme"),
    ('activations', 'nvme', "offload.activations='nvme' is not a tier for it: use one of device, host"),
    ('embed_head', 'gpu', "offload.embed_head='gpu'"),
    ('codec', 'lz4', "offload.codec='lz4': use one of none, zstd, blosc"),
    ('prefetch_depth', -1, 'offload.prefetch_depth=-1 must be >= 1'),
    ('layers_per_group', -1, 'offload.layers_per_group=-1 must be between 1'),
    ('layers_per_group', 9, 'offload.layers_per_group=9 must be between 1 and model.num_layers=4'),
    ('optimizer_on', 'host', 'needs offload.params and offload.opt_state off the device'),
    ('optimizer_on', 'tpu', 'offload.optimizer_on'),
    ('keep_layer_inputs', 'yes', "offload.keep_layer_inputs='yes': use true"),
    ('keep_layer_inputs', 'auto', 'or auto (in a config, for the planner)'),
    ('park_grads', 'host', "offload.park_grads='host': use weights"),
    ('park_grads', 'auto', 'or auto (in a config, for the planner)'),
])
def test_bad_placements(field, value, message):
  with pytest.raises(ConfigError, match=message.replace('(', r'\(').replace(')', r'\)')):
    Placement(**{field: value}).check(CFG)


def test_gradients_parked_on_the_device_need_the_update_there():
  with pytest.raises(ConfigError, match="offload.optimizer_on='host' updates on the host"):
    Placement(params='host', opt_state='host', optimizer_on='host', park_grads='device').check(CFG)


def test_host_tier_needs_the_pinned_host_memory_kind(monkeypatch):
  class NoHostMemory:  # a backend whose device offers only device memory
    platform, device_kind = 'fake', 'Fake accelerator'

    def addressable_memories(self):
      return [type('Memory', (), {'kind': 'device'})()]

  monkeypatch.setattr(jax, 'devices', lambda *a: [NoHostMemory()])
  with pytest.raises(ConfigError, match=r"offload.params=host needs the memory kind 'pinned_host'"):
    Placement(params='host', opt_state='host').check(CFG)


# ------------------------------------------------------------------------------------------------
# Through the training loop: the engine is chosen by the placement; checkpoints are portable.
# ------------------------------------------------------------------------------------------------

HOST_TIER = dict(offload__params='host', offload__opt_state='host', offload__activations='host',
                 offload__layers_per_group=1)


@pytest.mark.parametrize('first, second', [(HOST_TIER, {}), ({}, HOST_TIER)],
                         ids=['host-then-resident', 'resident-then-host'])
def test_checkpoints_move_between_engines(tmp_path, shared_data, monkeypatch, first, second):
  data = shared_data / 'wikitext-2' / 'valid.txt'
  train.train_and_evaluate(small_config(data, train__steps=8), str(tmp_path / 'reference'))
  run_until_crash(monkeypatch, small_config(data, train__steps=8, **first), tmp_path / 'moved',
                  crash_after_checkpoint=4)
  train.train_and_evaluate(small_config(data, train__steps=8, **second), str(tmp_path / 'moved'))
  want = {r['step']: r for r in read_rows(tmp_path / 'reference')}
  got = {r['step']: r for r in read_rows(tmp_path / 'moved')}
  assert sorted(got) == sorted(want) == list(range(0, 9))
  for step in range(1, 9):
    np.testing.assert_allclose(got[step]['learning/loss'], want[step]['learning/loss'], rtol=1e-5)
  np.testing.assert_allclose(got[8]['eval/loss'], want[8]['eval/loss'], rtol=1e-5)
  streamed_rows = [got[s] for s in (range(1, 5) if first else range(5, 9))]
  assert all(r['io/h2d_gb'] > 0 and r['io/d2h_gb'] > 0 and r['perf/compute_s'] > 0
             and r['perf/fetch_wait_s'] >= 0 and r['perf/optimizer_s'] >= 0 for r in streamed_rows)


@pytest.mark.parametrize('placement', [
    dict(layers_per_group=1, park_grads='device'),
    dict(layers_per_group=2, keep_layer_inputs=True),
    dict(layers_per_group=3, optimizer_on='host', activations='host'),
], ids=['K=1', 'K=2-layer-inputs', 'K=3-host-optimizer'])
def test_document_mask_streamed_matches_resident(placement):
  """model.document_mask: every microbatch has its own positions and segments, in the forward,
  the backward and evaluation, as in the resident step."""
  tx, schedule, clip = make_tx(1.0)
  data = with_documents(batches(2), seed=11)
  res = resident.ResidentEngine(DOCUMENTS_CFG, tx, schedule, clip,
                                jax.tree.map(np.copy, initial_state()))
  streamed = StreamedEngine(DOCUMENTS_CFG, tx, schedule, clip,
                            Placement(params='host', opt_state='host', **placement),
                            jax.tree.map(np.copy, initial_state()))
  evals = [b[m] for b in data[:2] for m in range(2)]
  np.testing.assert_allclose(streamed.eval_losses(evals), res.eval_losses(evals), rtol=1e-6)
  want = [float(res.train_step(b)['learning/loss']) for b in data]
  got = [float(streamed.train_step(b)['learning/loss']) for b in data]
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert_states_match(streamed.export_state(), jax.tree.map(np.asarray, res.export_state()))
  # The mask changes the numbers (the same batches without it).
  plain = resident.ResidentEngine(CFG, tx, schedule, clip, jax.tree.map(np.copy, initial_state()))
  assert abs(float(plain.train_step(data[0])['learning/loss']) - want[0]) > 1e-3


@pytest.mark.parametrize('placement', [
    dict(layers_per_group=1, park_grads='device'),
    dict(layers_per_group=2, keep_layer_inputs=True, optimizer_on='host', activations='host'),
], ids=['K=1', 'K=2-layer-inputs-host-optimizer'])
def test_documents_the_batch_marks_streamed_match_resident(placement):
  """data.Batch.starts (documents as the prepared data records them): the streamed engine keeps
  the documents they mark apart in the forward, the backward and evaluation, as the resident
  step does; they decide, not the EOS ids the tokens hold (found by those, other numbers)."""
  tx, schedule, clip = make_tx(1.0)
  rng = np.random.default_rng(5)
  data = []
  for tokens in with_documents(batches(2), seed=11):
    starts = (rng.random(tokens.shape) < 0.15).astype(np.uint8)
    data.append(Batch(tokens, data_lib.unlearn_starts(starts, None), starts))
  res = resident.ResidentEngine(DOCUMENTS_CFG, tx, schedule, clip,
                                jax.tree.map(np.copy, initial_state()))
  streamed = StreamedEngine(DOCUMENTS_CFG, tx, schedule, clip,
                            Placement(params='host', opt_state='host', **placement),
                            jax.tree.map(np.copy, initial_state()))
  evals = [Batch(*(a[m] for a in b)) for b in data[:2] for m in range(2)]
  np.testing.assert_allclose(streamed.eval_losses(evals), res.eval_losses(evals), rtol=1e-6)
  want = [float(res.train_step(b)['learning/loss']) for b in data]
  got = [float(streamed.train_step(b)['learning/loss']) for b in data]
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert_states_match(streamed.export_state(), jax.tree.map(np.asarray, res.export_state()))
  by_id = resident.ResidentEngine(DOCUMENTS_CFG, tx, schedule, clip,
                                  jax.tree.map(np.copy, initial_state()))
  first = Batch(data[0].tokens, data[0].loss_mask)  # no starts: documents end at each EOS id
  assert abs(float(by_id.train_step(first)['learning/loss']) - want[0]) > 1e-3


@pytest.mark.parametrize('placement', [
    dict(layers_per_group=1, park_grads='device'),
    dict(layers_per_group=2, keep_layer_inputs=True, optimizer_on='host'),
], ids=['K=1', 'K=2-layer-inputs-host-optimizer'])
def test_qk_norm_streamed_matches_resident(placement):
  """model.qk_norm (Qwen3: an RMSNorm over each head's q and k, scales [L, head_dim], here with
  head_dim 16 != d_model / num_heads) trains the same streamed as resident: the norms' scales
  stream and update with the layers (without weight decay, as every norm scale)."""
  cfg = CFG.replace(qk_norm=True, head_dim=16)
  tx, schedule, clip = make_tx(1.0)
  state = jax.tree.map(np.asarray, jax.jit(resident.init_state, static_argnums=(0, 1))(cfg, tx, 0))
  assert state['params']['layers']['attn']['q_norm']['scale'].shape == (4, 16)
  res = resident.ResidentEngine(cfg, tx, schedule, clip, jax.tree.map(np.copy, state))
  streamed = StreamedEngine(cfg, tx, schedule, clip,
                            Placement(params='host', opt_state='host', **placement),
                            jax.tree.map(np.copy, state))
  data = batches(2)
  want = [float(res.train_step(b)['learning/loss']) for b in data]
  got = [float(streamed.train_step(b)['learning/loss']) for b in data]
  np.testing.assert_allclose(got, want, rtol=1e-6)
  final = jax.tree.map(np.asarray, res.export_state())
  assert_states_match(streamed.export_state(), final)
  moved = final['params']['layers']['attn']['k_norm']['scale']
  assert np.abs(moved - 1.0).max() > 1e-3  # the norms were trained
