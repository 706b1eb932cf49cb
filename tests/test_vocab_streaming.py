"""The embedding and LM head stream in vocabulary chunks (issue 10): the streamed engine keeps them
in chunks of at most offload.shard_mb in any tier (device, host, nvme), runs the head's loss chunk
by chunk with an online logsumexp, and still trains to the resident engine's numbers; tied and
untied heads, device and host optimizers."""

import collections
import dataclasses
import os
import pathlib

import jax
import numpy as np
import pytest

from megatrain_jax import profiling
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


def test_a_fresh_init_compiles_one_program_per_vocabulary_chunk_size(monkeypatch):
  """The streamed engine draws its vocabulary chunks with one program per chunk size, the start
  traced: a 128k vocabulary in 16 chunks of the embedding and 16 of the head compiled 32 programs
  (a second each on a GPU, and 5 MB of host memory each: planner.init_programs counts them)."""
  from megatrain_jax import model as model_lib  # pylint: disable=import-outside-toplevel
  from megatrain_jax import planner  # pylint: disable=import-outside-toplevel
  traced = []
  init_outer_piece = model_lib.init_outer_piece

  def counting(cfg, key, kind, start=0, count=0):
    traced.append((kind, count))  # once per trace: once per compiled program
    return init_outer_piece(cfg, key, kind, start, count)

  monkeypatch.setattr(model_lib, 'init_outer_piece', counting)
  tx, schedule, clip = make_tx(1.0)
  cfg = dataclasses.replace(CFG, vocab_size=4000)  # 8 chunks of 512 rows, the last of 416
  placement = Placement(params='host', opt_state='host', embed_head='host', shard_mb=0.0625)
  engine = StreamedEngine(cfg, tx, schedule, clip, placement, seed=0)
  assert len(engine.vocab) == 8
  assert sorted(set(traced)) == sorted(traced)  # no program compiled twice
  assert sorted(traced) == [('embed', 416), ('embed', 512), ('final_norm', 0), ('head', 416),
                            ('head', 512)]
  assert planner.init_programs(cfg, placement) == len(traced)
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


@pytest.mark.parametrize('block', [16, 64])  # 16: drawn in blocks; 64: the whole vocabulary at once
@pytest.mark.parametrize('tied', [True, False])
def test_outer_pieces_drawn_alone_equal_the_whole_init(monkeypatch, tied, block):
  """The streamed engine initialises each vocabulary chunk alone (layers.vocab_normal); chunks
  that straddle the init's row blocks must hold exactly the whole matrix's rows."""
  from megatrain_jax import partition  # pylint: disable=import-outside-toplevel
  from megatrain_jax.model import decoder, layers  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(layers, 'VOCAB_INIT_BLOCK', block)
  cfg = decoder.ModelConfig(vocab_size=50, d_model=8, num_layers=1, num_heads=2, num_kv_heads=1,
                              d_ff=16, max_seq_len=16, tie_embeddings=tied)
  key = jax.random.key(3)
  whole = decoder.init_outer(cfg, key)
  jitted_whole = jax.jit(decoder.init_outer, static_argnums=0)(cfg, key)
  kinds = ['embed', 'final_norm'] + ([] if tied else ['head'])
  for kind in kinds:
    ranges = [(0, 0)] if kind == 'final_norm' else [(0, 7), (7, 30), (30, 50)]
    for start, stop in ranges:
      got = decoder.init_outer_piece(cfg, key, kind, start, stop - start)
      want = partition.piece_of(whole, kind, start, stop)
      jax.tree.map(np.testing.assert_array_equal, got, want)
      # a traced start (the streamed engine's one program per chunk size) draws the rows of the
      # jitted whole init (the resident engine's; eager arithmetic may round the last bit apart)
      traced = jax.jit(decoder.init_outer_piece, static_argnums=(0, 2, 4))(
          cfg, key, kind, start, stop - start)
      jax.tree.map(np.testing.assert_array_equal, traced,
                   partition.piece_of(jitted_whole, kind, start, stop))
  assert float(np.std(whole['embed']['embedding'])) == pytest.approx(cfg.init_std, rel=0.2)


RSS_ARGS = ['--config.model.vocab_size=131072', '--config.model.d_model=256',
            '--config.model.num_layers=2', '--config.model.num_heads=8',
            '--config.model.num_kv_heads=4', '--config.model.d_ff=688',
            '--config.offload.params=nvme', '--config.offload.opt_state=nvme',
            '--config.offload.embed_head=nvme', '--config.train.batch_size=1',
            '--config.train.seq_len=64', '--config.train.steps=1', '--config.train.eval_batches=1',
            '--config.checkpoint.every=0', '--config.train.progress_bar=False']


def test_peak_host_memory_of_a_128k_vocabulary_run_is_planned(tmp_path):
  """The whole launch.py process (init, step, eval, end-of-run checkpoint) on a 128k-vocabulary
  model whose embedding is most of its state, everything on NVMe, stays within the planner's
  predicted_host_peak_gb (0.8-1.25x) and far below holding the embedding whole."""
  import re, subprocess, sys  # pylint: disable=import-outside-toplevel,multiple-imports
  root = pathlib.Path(__file__).resolve().parents[1]
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  dry = subprocess.run([sys.executable, str(root / 'launch.py'), '--dry_run', *RSS_ARGS,
                        f'--workdir={tmp_path / "dry"}'], capture_output=True, text=True,
                       env=env, timeout=300, cwd=root)
  assert dry.returncode == 0, dry.stderr[-2000:]
  predicted = float(re.search(r'predicted_host_peak_gb: ([0-9.]+)', dry.stdout).group(1)) * 1e9
  state = int(re.search(r'params: (\d+)', dry.stdout).group(1)) * 12  # params + Adam m, v
  # A wrapper process whose only child is the run: its RUSAGE_CHILDREN peak is the run's.
  wrapper = ('import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); '
             'print("PEAK", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); '
             'sys.exit(r.returncode)')
  run = subprocess.run([sys.executable, '-c', wrapper, sys.executable, str(root / 'launch.py'),
                        *RSS_ARGS, f'--workdir={tmp_path / "run"}'], capture_output=True,
                       text=True, env=env, timeout=900, cwd=root)
  assert run.returncode == 0, run.stderr[-3000:]
  peak = int(re.search(r'PEAK (\d+)', run.stdout).group(1))
  assert (tmp_path / 'run' / 'checkpoints' / '1').is_dir()
  assert 0.8 * predicted <= peak <= 1.25 * predicted, (peak / 1e9, predicted / 1e9)
  # The embedding's params + Adam state (403 MB) are most of the state: held whole, they alone
  # would put the run above the runtime plus half of them.
  assert peak < 0.95e9 + state / 2, (peak / 1e9, state / 1e9)


def test_peak_host_memory_of_a_152k_vocabulary_eval_is_planned(tmp_path):
  """`launch.py --eval` of a Qwen2-shaped model with 151,936 ids (the head chunks' logits are
  most of a call's working set): 32 windows of 512 tokens asked per call run a few at a time
  within eval.working_gb, and the whole process peaks within 0.8-1.25x of the printed
  predicted_host_peak_gb. Before, every call held its 32 windows' logits chunks and the untrimmed
  heap's holes beside them (7.5 GB for a 0.67 GB model at 32 x 2048)."""
  import re, subprocess, sys  # pylint: disable=import-outside-toplevel,multiple-imports
  import tokenizers, torch, transformers  # pylint: disable=import-outside-toplevel,multiple-imports
  root = pathlib.Path(__file__).resolve().parents[1]
  model_dir = tmp_path / 'qwen2'
  torch.manual_seed(0)
  transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
      vocab_size=151_936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
      tie_word_embeddings=False)).save_pretrained(model_dir)
  text = tmp_path / 'eval.txt'
  text.write_text((root.parent / 'shared/data/wikitext-2/test.txt').read_text()[:12_000])
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.train_from_iterator([text.read_text()], tokenizers.trainers.BpeTrainer(
      vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False))
  tok.save(str(model_dir / 'tokenizer.json'))
  wrapper = ('import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); '
             'print("PEAK", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); '
             'sys.exit(r.returncode)')
  run = subprocess.run(
      [sys.executable, '-c', wrapper, sys.executable, str(root / 'launch.py'), '--eval',
       f'--workdir={tmp_path / "run"}', f'--config.init.from_hf={model_dir}',
       f'--config.eval.path={text}', '--config.eval.max_len=512', '--config.eval.batch_size=32',
       '--config.eval.working_gb=0.1', '--config.train.progress_bar=False'],
      capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS='cpu'), timeout=600,
      cwd=root)
  assert run.returncode == 0, run.stderr[-3000:]
  rows = int(re.search(r'windows of 512 tokens, (\d+) per call \(eval.batch_size=32 lowered',
                       run.stdout).group(1))
  assert 1 <= rows < 16  # the 16 windows there are (8,084 tokens), had they all fit 0.1 GB
  predicted = float(re.search(r'predicted_host_peak_gb: ([0-9.]+)', run.stdout).group(1)) * 1e9
  peak = int(re.search(r'PEAK (\d+)', run.stdout).group(1))
  assert 0.8 * predicted <= peak <= 1.25 * predicted, (peak / 1e9, predicted / 1e9)


def _programs_per_step(shard_mb: float, num_micro: int):
  """(vocabulary chunks, programs by name) of the second step of a streamed engine whose
  vocabulary chunks are at most `shard_mb` (no clipping: every update runs in its own step)."""
  tx, schedule, clip = make_tx(0.0)
  cfg = dataclasses.replace(CFG, num_layers=1)
  placement = Placement(params='host', opt_state='host', embed_head='host', shard_mb=shard_mb)
  engine = StreamedEngine(cfg, tx, schedule, clip, placement, seed=0)
  batch = np.random.default_rng(0).integers(0, 97, (num_micro, 2, 17)).astype(np.int32)
  engine.train_step(batch)  # compiles
  with profiling.programs_executed() as programs:
    float(engine.train_step(batch)['learning/loss'])
  engine.close()
  return len(engine.vocab), programs


def test_each_vocabulary_chunk_adds_only_its_own_programs():
  """Each vocabulary chunk adds to a step the programs of its stages, one per microbatch each
  (embedding, loss, head backward, embedding backward), and one update per piece: nothing else.
  Python dispatches every program of a streamed step, and at a real vocabulary (Llama 3: 32
  chunks of a small model) a step ran 224 more eager programs with M = 4 (each chunk's start
  made a jnp.int32 per call), a sum of squares per chunk and an eager add per piece of the
  global norm: 372 of its 1,137 programs."""
  num_micro = 2
  chunks, fewer = _programs_per_step(2 * SHARD_MB, num_micro)  # 64 and 33 rows
  more_chunks, more = _programs_per_step(SHARD_MB, num_micro)  # 32, 32, 32 and 1 rows
  assert (chunks, more_chunks) == (2, 4)
  added = collections.Counter(more)
  added.subtract(fewer)
  per_chunk = {'embed_chunk_add': num_micro, '_lse_update': num_micro,
               'head_chunk_backward': num_micro, 'embed_chunk_backward': num_micro,
               'device_update': 2}  # the embedding's and the head's
  assert {name: n for name, n in added.items() if n} == {
      name: n * (more_chunks - chunks) for name, n in per_chunk.items()}
