"""The runs tests/test_distributed.py checks, in a process of their own with 4 forced CPU devices.

XLA fixes the number of CPU devices when jax creates its backend, from
XLA_FLAGS=--xla_force_host_platform_device_count=N; a pytest worker has created its backend with
one device long before, so the test runs this script as a subprocess (its environment sets the
flag) and reads back what it prints: one JSON object, on the last line.

    python tests/distributed_runs.py OFFLOAD_DIR WORKDIR DATA_PATH
    python tests/distributed_runs.py --process I COORDINATOR_ADDRESS WORKDIR  # I = 0, 1; below
    python tests/distributed_runs.py --train I COORDINATOR_ADDRESS WORKDIR DATA_PATH STEPS PLACEMENT [MODEL]
    python tests/distributed_runs.py --continue WORKDIR DATA_PATH STEPS PLACEMENT DEVICES [MODEL]

Every run trains the parity harness's model (helpers.CFG) from the same initial state for
helpers.STEPS steps of M = 2 microbatches of B = 4 sequences (B must split over the 4 devices:
helpers.batches has B = 2), with exact clipping. The reference is the resident engine on one
device (a one-device Layout in this same process; tests/test_streamed.py shows the streamed
engine on one device equals it); the others run on a Layout over all 4 devices:

    resident   the resident engine
    host       streamed: layers, embedding/head and activations in pinned host memory, AdamW on
               the host, two layers per group (the host update's per-leaf output shardings)
    nvme       streamed: layers and embedding/head on NVMe, AdamW on the device
    train      train.train_and_evaluate of a 2-step run with parallel.devices = 4 (the startup
               line, a checkpoint of the sharded state)
    trainer    train.train_and_evaluate runs of the small config (`trainer_config`): 4 steps on 1
               device (the reference of every trainer run), and 2 steps on 1 device resumed to 4
               on 4 devices (a checkpoint written on 1 device, read on 4)

    collectives  the compiled 4-device resident step and streamed group functions (fed a
               sequence length of ACTIVATION_SEQ, which no weight has as a dimension): the
               shapes of their all-reduce and reduce-scatter operands

For each: its losses, the error of its final state against the reference
(helpers.assert_states_match; None when it passes) and how a large leaf is split.

With --process, this is process I of 2, each with 2 CPU devices, joined by jax.distributed
(gloo): the resident engine and the streamed engine with host and NVMe placements on a Layout over
the 4 devices of both, each process feeding its 2 rows of every microbatch; it reports the losses
(the final state is sharded across the processes: no one process can read it whole). Then both
checkpoint a fresh NVMe init at step 0 into the shared WORKDIR, which the test reads back on one
device, and start engines from a checkpoint both wrote, from its weights alone and from a Hugging
Face checkpoint (`restored_runs`): their losses, and how much of each source each process read.

With --train, process I of 2 (2 CPU devices each) runs train.train_and_evaluate of the small
config to STEPS in the shared WORKDIR with PLACEMENT ('resident', 'host' or 'nvme'); process 0
reports the losses it logged. With --continue, one process (4 CPU devices) runs the same
config to STEPS in WORKDIR on the first DEVICES of them: it resumes what the processes wrote.
"""

import os
import sys

LOCAL_DEVICES = 2 if sys.argv[1:2] in (['--process'], ['--train']) else 4
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '')
                           + f' --xla_force_host_platform_device_count={LOCAL_DEVICES}').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import contextlib  # noqa: E402 (after XLA_FLAGS: jax reads it when its backend starts)
import io  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from helpers import (CFG, DOCUMENTS_CFG, JAX_CACHE_DIR, STEPS,  # noqa: E402
                     assert_states_match, initial_state, make_tx, small_config, with_documents)
from megatrain_jax import distributed, hardware, planner, train  # noqa: E402
from megatrain_jax.checkpoint import Checkpointer, WeightsOnly  # noqa: E402
from megatrain_jax.data import Batch, unlearn_starts  # noqa: E402
from megatrain_jax.engine import resident  # noqa: E402
from megatrain_jax.engine.functions import StageFunctions  # noqa: E402
from megatrain_jax.engine.streamed import StreamedEngine  # noqa: E402
from megatrain_jax.errors import ConfigError  # noqa: E402
from megatrain_jax.hf import HfReader  # noqa: E402
from megatrain_jax.hf.format import inspect_checkpoint, save_hf  # noqa: E402
from megatrain_jax.layout import Layout  # noqa: E402
from megatrain_jax.placement import Placement  # noqa: E402
from megatrain_jax.tiers.base import resolve  # noqa: E402

MICRO, BATCH = 2, 4
PLACEMENTS = {
    'host': dict(params='host', opt_state='host', embed_head='host', activations='host',
                 optimizer_on='host', layers_per_group=2),
    'nvme': dict(params='nvme', opt_state='nvme', embed_head='nvme', optimizer_on='device'),
}


def batches() -> list[np.ndarray]:
  """STEPS batches of token ids [M, B, S+1] = [2, 4, 17]."""
  rng = np.random.default_rng(13)
  return [rng.integers(0, CFG.vocab_size, (MICRO, BATCH, 17)).astype(np.int32)
          for _ in range(STEPS)]


def split(x) -> dict:
  """How leaf `x` (a jax.Array) is split: its PartitionSpec, device count and memory kind."""
  return {'spec': str(x.sharding.spec), 'devices': len(x.sharding.device_set),
          'memory_kind': x.sharding.memory_kind, 'shape': list(x.shape)}


def resident_run(layout: Layout, export: bool = True, cfg=CFG, data=None):
  tx, schedule, clip = make_tx(1.0)
  engine = resident.ResidentEngine(cfg, tx, schedule, clip, jax.tree.map(np.copy, initial_state()),
                                   layout=layout)
  losses = [float(engine.train_step(b)['learning/loss']) for b in data or batches()]
  kernel = engine.state['params']['layers']['mlp']['gate_proj']['kernel']  # [L, D, F]
  moment = engine.state['opt_state'][0].mu['layers']['mlp']['gate_proj']['kernel']
  splits = {'params gate_proj': split(kernel), 'adam mu gate_proj': split(moment)}
  return losses, jax.tree.map(np.asarray, engine.export_state()) if export else None, splits


def streamed_run(layout: Layout, offload_dir: str, export: bool = True, cfg=CFG, data=None,
                 **placement):
  tx, schedule, clip = make_tx(1.0)
  placement = Placement(**placement, dir=offload_dir)
  placement.check(cfg)
  engine = StreamedEngine(cfg, tx, schedule, clip, placement,
                          jax.tree.map(np.copy, initial_state()), layout=layout)
  try:
    losses = [float(engine.train_step(b)['learning/loss']) for b in data or batches()]
    group = resolve(engine.stores['layers'].params.fetch(0))  # [K, D, F] kernels, fetched
    chunk = resolve(engine.stores['embed'].params.fetch(0))  # [Vc, D]
    splits = {'fetched gate_proj': split(group['layers']['mlp']['gate_proj']['kernel']),
              'fetched embedding chunk': split(chunk['embed']['embedding'])}
    if placement.params == 'host':  # what the host tier keeps between uses
      kept = engine.stores['layers'].params.get(0)['layers']['mlp']['gate_proj']['kernel']
      splits['host-tier gate_proj'] = split(kept)
    return losses, engine.export_state() if export else None, splits
  finally:
    engine.close()


def document_mask_runs(four: Layout, offload_dir: str) -> dict:
  """model.document_mask (EOS 3, at random places: each microbatch and row packs its own
  documents; 'marked': data.Batch.starts at other random places, documents as prepared data
  records them) on one device, and the resident and host-tier streamed engines on the 4
  devices: {'reference' / 'marked reference': losses, name: {'losses', 'state_error'}}."""
  cfg, data = DOCUMENTS_CFG, with_documents(batches(), seed=17)
  rng = np.random.default_rng(18)
  marked = []
  for tokens in data:
    starts = (rng.random(tokens.shape) < 0.15).astype(np.uint8)
    marked.append(Batch(tokens, unlearn_starts(starts, None), starts))
  out = {}
  for prefix, steps in (('', data), ('marked ', marked)):
    ref_losses, ref_state, _ = resident_run(Layout.single_device(), cfg=cfg, data=steps)
    out[prefix + 'reference'] = ref_losses
    for name, run in [('resident', lambda: resident_run(four, cfg=cfg, data=steps)),
                      ('host', lambda: streamed_run(four, offload_dir, cfg=cfg, data=steps,
                                                    **PLACEMENTS['host']))]:
      losses, state, _ = run()
      out[prefix + name] = {'losses': losses, 'state_error': state_error(state, ref_state)}
  return out


def train_run(workdir: str, data_path: str) -> dict:
  """A 2-step train.train_and_evaluate on the 4 devices: its startup line and last metrics."""
  config = small_config(data_path, train__steps=2, train__eval_every=2, checkpoint__every=2,
                        parallel__devices=4)
  console = io.StringIO()
  with contextlib.redirect_stdout(console):
    last = train.train_and_evaluate(config, workdir)
  started = [line for line in console.getvalue().splitlines() if line.startswith('model:')]
  return {'startup': started, 'loss': last.get('learning/loss'), 'eval': last.get('eval/loss')}


ACTIVATION_SEQ = 24  # a sequence length that is no dimension of any weight of helpers.CFG
REDUCTION = re.compile(r' = (.*?) (?:all-reduce|reduce-scatter)(?:-start)?\(')


def reduced_shapes(compiled) -> list[str]:
  """The result shapes (f32[2,24,32], ...) of the all-reduces and reduce-scatters in a compiled
  program's HLO (not its all-to-alls: the embedding lookup, whose table is split along D, moves
  its rows to the batch split with one)."""
  return [shape for line in compiled.as_text().splitlines()
          for types in REDUCTION.findall(line) for shape in re.findall(r'\w+\[[\d,]*\]', types)]


def collectives(layout: Layout) -> dict:
  """What the 4-device programs reduce over the devices, fed [M, B, S+1] = [2, 4, 25] tokens:
  with each layer's weights gathered whole and its input split along B (Layout.shard_layer),
  only gradients and scalars; an operand with the sequence axis (24) would be an activation,
  i.e. GSPMD splitting the layers' matmuls across devices (tensor parallelism) instead."""
  tx, schedule, clip = make_tx(1.0)
  tokens = np.zeros((MICRO, BATCH, ACTIVATION_SEQ + 1), np.int32)
  engine = resident.ResidentEngine(CFG, tx, schedule, clip, jax.tree.map(np.copy, initial_state()),
                                   layout=layout)
  step = engine._train_step.lower(  # pylint: disable=protected-access
      engine.state, layout.put_batch(tokens), None, None)
  fn = StageFunctions(CFG, tx, layout)
  params = layout.put(initial_state()['params'], 'device')
  group = {'layers': jax.tree.map(lambda a: a[:2], params['layers'])}  # K = 2 layers
  activation = np.zeros((BATCH, ACTIVATION_SEQ, CFG.d_model), np.float32)
  x = layout.put_activation(activation, 'device')  # [B, S, D] split along B
  inputs = jax.device_put(np.stack([activation] * 2), layout.split_along(1))  # [K, B, S, D]
  positions = layout.put_batch(np.zeros((BATCH, ACTIVATION_SEQ), np.int32))
  zeros = layout.put(jax.tree.map(np.zeros_like, group), 'device')  # a gradient sum to add to
  programs = {
      'resident step': step.compile(),
      'group forward': fn.group_forward.lower(group, x, positions).compile(),
      'group backward': fn.group_backward.lower(group, x, x, positions, zeros).compile(),
      'group backward from inputs': fn.group_backward_from_inputs.lower(
          group, inputs, x, positions, zeros).compile(),
  }
  return {'sequence': ACTIVATION_SEQ,
          'programs': {name: reduced_shapes(p) for name, p in programs.items()}}


def bad_batch(layout: Layout) -> str:
  """The error of a batch of 6 sequences on 4 devices."""
  try:
    layout.put_batch(np.zeros((MICRO, 6, 17), np.int32))
  except ConfigError as error:
    return str(error)
  return ''


def state_error(got, want) -> str | None:
  try:
    assert_states_match(got, want)
  except AssertionError as error:
    return repr(error)
  return None


def main(offload_dir: str, workdir: str, data_path: str) -> dict:
  jax.config.update('jax_compilation_cache_dir', JAX_CACHE_DIR)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  four = Layout.for_devices(jax.devices())
  assert four.num_devices == 4, jax.devices()
  started = time.perf_counter()
  ref_losses, ref_state, _ = resident_run(Layout.single_device())
  out = {'reference': ref_losses, 'bad_batch': bad_batch(four), 'seconds': {},
         'collectives': collectives(four)}
  out['seconds']['reference'] = time.perf_counter() - started
  runs = {'resident': lambda: resident_run(four)}
  runs.update({name: lambda name=name, placement=placement: streamed_run(
      four, str(pathlib.Path(offload_dir) / name), **placement)
      for name, placement in PLACEMENTS.items()})
  for name, run in runs.items():
    started = time.perf_counter()
    losses, state, splits = run()
    out[name] = {'losses': losses, 'state_error': state_error(state, ref_state), 'splits': splits}
    out['seconds'][name] = time.perf_counter() - started
  started = time.perf_counter()
  out['document_mask'] = document_mask_runs(four, str(pathlib.Path(offload_dir) / 'documents'))
  out['seconds']['document_mask'] = time.perf_counter() - started
  started = time.perf_counter()
  out['train'] = train_run(workdir, data_path)
  out['seconds']['train'] = time.perf_counter() - started
  started = time.perf_counter()
  out['trainer'] = trainer_runs(f'{workdir}-trainer', data_path)
  out['seconds']['trainer'] = time.perf_counter() - started
  return out


def process_main(process_id: str, coordinator: str, workdir: str) -> dict:
  """Process `process_id` of 2: the resident and streamed runs on the 4 devices of both; then a
  fresh NVMe init checkpointed at step 0 into `workdir` (shared)."""
  distributed.initialize(coordinator, 2, int(process_id))
  jax.config.update('jax_compilation_cache_dir', JAX_CACHE_DIR)
  layout = Layout.for_devices(jax.devices())
  assert layout.num_devices == 4 and len(jax.local_devices()) == 2, jax.devices()
  value_checks = _count_value_checks()
  losses, _, splits = resident_run(layout, export=False)
  out = {'process': jax.process_index(), 'resident': {'losses': losses, 'splits': splits}}
  with tempfile.TemporaryDirectory() as offload:
    for name, placement in PLACEMENTS.items():
      losses, _, splits = streamed_run(layout, f'{offload}/{name}', export=False, **placement)
      out[name] = {'losses': losses, 'splits': splits}
  fresh_nvme_checkpoint(layout, workdir)
  out['value_checks'] = value_checks
  out['restored'] = restored_runs(layout, pathlib.Path(workdir))
  config = trainer_config('', 1, parallel__devices=4)
  out['sharing'] = planner.devices_for(config).sharing
  hw = hardware.load_profile('cpu')
  out['host_budget'] = planner.budgets_for(hw, config.offload, 100.0, out['sharing'])['host']
  out['host_gb'] = hw.host_memory_gb
  return out


def restored_runs(layout: Layout, workdir: pathlib.Path) -> dict:
  """The host placement trains steps 1-2 and checkpoints them (every leaf an in-memory array,
  written by both processes); the resident engine and the host and NVMe placements restore that
  checkpoint and train steps 3-5. Its weights alone (init.from_run: checkpoint.WeightsOnly) in
  the host placement, and a Hugging Face checkpoint of the initial params (process 0 writes it)
  in the resident engine and the NVMe placement, one step each. Each reports its losses and the
  bytes its reader read in this process, as a fraction of what the source holds (the whole
  state; the params)."""
  tx, schedule, clip = make_tx(1.0)
  data, out = batches(), {}
  engine = StreamedEngine(CFG, tx, schedule, clip, Placement(**PLACEMENTS['host']),
                          jax.tree.map(np.copy, initial_state()), layout=layout)
  both = Checkpointer(workdir / 'damaged', keep=2)  # steps 1 and 2, the newest damaged below
  out['first'] = []
  for step, batch in enumerate(data[:2], 1):
    out['first'].append(float(engine.train_step(batch)['learning/loss']))
    both.save(step, engine, data_position=0, model_cfg=CFG)
  both.close()
  checkpointer = Checkpointer(workdir / 'restored', keep=1)
  checkpointer.save(2, engine, data_position=0, model_cfg=CFG)
  checkpointer.close()
  engine.close()
  if jax.process_index() == 0:
    save_hf(workdir / 'hf', CFG, initial_state()['params'])
    _flip_a_byte_of_one_chunk(workdir / 'damaged' / 'checkpoints' / '2')
  distributed.barrier('restored: the checkpoints are written')
  # Each process verifies its share of the chunks; the one whose share holds the flipped byte
  # speaks for both, and both fall back to step 1.
  out['verified'] = Checkpointer(workdir / 'restored', keep=1).restore(CFG).bytes_verified
  out['damaged'] = Checkpointer(workdir / 'damaged', keep=2).restore(CFG).step
  abstract = resident.abstract_state(CFG, tx)
  restore = Checkpointer(workdir / 'restored', keep=1).restore
  placements = {'resident': {}, 'host': PLACEMENTS['host'],
                'nvme': dict(PLACEMENTS['nvme'], dir=str(workdir / 'offload'))}
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(initial_state()))
  out['verified'] /= state_bytes
  params_bytes = sum(x.nbytes for x in jax.tree.leaves(initial_state()['params']))
  runs = [  # (source, its reader, placements, steps, bytes it holds)
      ('checkpoint', lambda: restore(CFG), placements, data[2:], state_bytes),
      ('run', lambda: WeightsOnly(restore(CFG), abstract), ['host'], data[2:3], params_bytes),
      ('hf', lambda: HfReader(inspect_checkpoint(workdir / 'hf'), abstract), ['resident', 'nvme'],
       data[:1], params_bytes)]
  trainer = types.SimpleNamespace(grad_clip=clip, seed=0)  # what make_engine reads of config.train
  for source, open_reader, names, steps, source_bytes in runs:
    for name in names:
      reader = open_reader()
      engine = train.make_engine(CFG, tx, schedule, trainer, Placement(**placements[name]),
                                 restore_from=reader, layout=layout)
      out[f'{source} {name}'] = {
          'losses': [float(engine.train_step(b)['learning/loss']) for b in steps],
          'read': reader.bytes_read / source_bytes}
      getattr(engine, 'close', lambda: None)()
  return out


def _flip_a_byte_of_one_chunk(checkpoint: pathlib.Path) -> None:
  """Flips the middle byte of the largest chunk file of `checkpoint` (one inner chunk damaged)."""
  chunks = [p for p in checkpoint.rglob('*') if p.is_file() and '/c/' in str(p)]
  victim = max(chunks, key=lambda p: (p.stat().st_size, str(p)))
  data = bytearray(victim.read_bytes())
  data[len(data) // 2] ^= 0xFF
  victim.write_bytes(bytes(data))


def _count_value_checks() -> list:
  """A list that collects the shapes jax all-gathers to check that a value put into shardings
  spanning processes is the same in every process (jax.device_put of a host value or of a local
  array does this: layout.place avoids it); the barriers' own checks (distributed.barrier) are
  not counted."""
  checks, check = [], multihost_utils.assert_equal

  def counted(x, fail_message=''):
    if not fail_message.startswith('sync_global_devices'):
      checks.append(list(np.shape(x)))
    return check(x, fail_message)

  multihost_utils.assert_equal = counted
  return checks


def fresh_nvme_checkpoint(layout: Layout, workdir: str) -> None:
  """A fresh init (seed 0) on NVMe, checkpointed before any step: AdamW's zeros are registered,
  not written (tiers/nvme.py), so each process must write its own parts of them for the
  checkpoint to hold whole arrays."""
  tx, schedule, clip = make_tx(1.0)
  placement = Placement(**PLACEMENTS['nvme'], dir=f'{workdir}/offload')
  engine = StreamedEngine(CFG, tx, schedule, clip, placement, seed=0, layout=layout)
  checkpointer = Checkpointer(pathlib.Path(workdir), keep=1)
  try:
    checkpointer.save(0, engine, data_position=0, model_cfg=CFG, placement=placement)
  finally:
    checkpointer.close()
    engine.close()


TRAINER_PLACEMENTS = {
    'resident': {},
    'host': dict(offload__params='host', offload__opt_state='host', offload__embed_head='host',
                 offload__layers_per_group=1),
    'nvme': dict(offload__params='nvme', offload__opt_state='nvme', offload__embed_head='nvme',
                 offload__layers_per_group=1),
}


def trainer_config(data_path: str, steps: int, placement: str = 'resident', **overrides):
  """The small config (helpers.small_config) for the trainer runs: 2 microbatches of 4
  sequences, a checkpoint every 2 steps, `placement` of TRAINER_PLACEMENTS."""
  return small_config(data_path, train__steps=steps, train__batch_size=4, train__microbatches=2,
                      train__eval_every=0, checkpoint__every=2, jax_cache_dir=JAX_CACHE_DIR,
                      **TRAINER_PLACEMENTS[placement], **overrides)


def logged_losses(workdir) -> dict:
  """{step: learning/loss} of a run's metrics.jsonl (a resumed run appends to it)."""
  rows = [json.loads(line) for line in (pathlib.Path(workdir) / 'metrics.jsonl').read_text()
          .splitlines()]
  return {r['step']: r['learning/loss'] for r in rows if 'learning/loss' in r}


def trainer_runs(workdir: str, data_path: str) -> dict:
  """4 steps on 1 device (a checkpoint every 2); the same run as if killed after its checkpoint
  of step 2 (that of step 4 deleted), resumed to 4 on the 4 devices."""
  with contextlib.redirect_stdout(io.StringIO()):
    train.train_and_evaluate(trainer_config(data_path, 4, parallel__devices=1),
                             f'{workdir}/reference')
    shutil.copytree(f'{workdir}/reference', f'{workdir}/one_to_four')
    shutil.rmtree(f'{workdir}/one_to_four/checkpoints/4')
    train.train_and_evaluate(trainer_config(data_path, 4, parallel__devices=4),
                             f'{workdir}/one_to_four')
  return {name: logged_losses(f'{workdir}/{name}') for name in ('reference', 'one_to_four')}


def continue_main(workdir: str, data_path: str, steps: str, placement: str, devices: str,
                  model: str = '{}') -> dict:
  """The run in `workdir` continued to `steps` on `devices` devices of this process (`model`:
  JSON of config overrides, e.g. other model shapes)."""
  config = trainer_config(data_path, int(steps), placement, parallel__devices=int(devices),
                          **json.loads(model))
  config.offload.dir = str(pathlib.Path(workdir) / 'offload')
  with contextlib.redirect_stdout(io.StringIO()):
    train.train_and_evaluate(config, workdir)
  return {'losses': logged_losses(workdir)}


def trainer_process_main(process_id: str, coordinator: str, workdir: str, data_path: str,
                         steps: str, placement: str, model: str = '{}') -> dict:
  """Process `process_id` of 2: train.train_and_evaluate on the 4 devices of both (`model`: as
  continue_main's)."""
  distributed.initialize(coordinator, 2, int(process_id))
  config = trainer_config(data_path, int(steps), placement, **json.loads(model))
  config.offload.dir = str(pathlib.Path(workdir) / 'offload')
  train.train_and_evaluate(config, workdir)
  return {'process': jax.process_index(),
          'losses': logged_losses(workdir) if jax.process_index() == 0 else None}


if __name__ == '__main__':
  if sys.argv[1] == '--process':
    print(json.dumps(process_main(*sys.argv[2:5])))
  elif sys.argv[1] == '--train':
    print(json.dumps(trainer_process_main(*sys.argv[2:9])))
  elif sys.argv[1] == '--continue':
    print(json.dumps(continue_main(*sys.argv[2:8])))
  else:
    print(json.dumps(main(*sys.argv[1:4])))
