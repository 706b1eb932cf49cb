"""Loss masks (issue 12): prompt/completion and chat data learn only their unmasked targets.

`learning/loss` and `eval/loss` are means over the learned (mask 1) targets only, the same in
every engine: per step over all M microbatches together (not a mean of the microbatches' means),
with the gradient of that same mean. A step with no learned target has loss 0 and zero gradients.
Checked against a float64 log-softmax over the whole logits, the streamed engine against the
resident one (host and NVMe tiers, M > 1, the embedding and head in vocabulary chunks), an
all-ones mask against the unmasked path, and a short end-to-end run on prompt/completion JSONL.
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megatrain_jax import data as data_lib
from megatrain_jax import model as model_lib
from megatrain_jax import runs as runs_lib
from megatrain_jax import train
from megatrain_jax.data import Batch, packing
from megatrain_jax.engine import resident
from megatrain_jax.engine.streamed import StreamedEngine
from megatrain_jax.placement import Placement

from helpers import CFG, STEPS, assert_states_match, initial_state, make_tx, read_rows, small_config

SHARD_MB = 0.004  # vocabulary chunks of 32 rows of d_model 32: 97 ids in 4 chunks


def masked_batches(num_micro: int, seed: int = 0) -> list[Batch]:
  """`STEPS` batches [num_micro, 2, 17] with masks whose learned-token counts differ a lot
  between microbatches (so a mean of microbatch means would be wrong), one row all zeros."""
  rng = np.random.default_rng(100 + seed + num_micro)
  out = []
  for _ in range(STEPS):
    tokens = rng.integers(0, CFG.vocab_size, (num_micro, 2, 17)).astype(np.int32)
    keep = np.linspace(0.9, 0.15, num_micro)[:, None, None]
    mask = (rng.random((num_micro, 2, 16)) < keep).astype(np.uint8)
    mask[0, 1] = 0  # a sequence with no learned target (a long prompt)
    out.append(Batch(tokens, mask))
  return out


def _params():
  return jax.tree.map(jnp.asarray, initial_state()['params'])


def _reference_loss(params, tokens: np.ndarray, mask: np.ndarray) -> float:
  """Σ mask·nll / Σ mask over every sequence of `tokens` [..., S+1], in float64 from the whole
  float32 logits (model.forward)."""
  tokens = tokens.reshape(-1, tokens.shape[-1])
  logits = np.asarray(jax.jit(model_lib.forward, static_argnums=0)(CFG, params, tokens[:, :-1]),
                      np.float64)
  logp = logits - logits.max(-1, keepdims=True)
  logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  m = mask.reshape(nll.shape).astype(np.float64)
  return float((nll * m).sum() / m.sum())


def _masked_mean_loss(params, flat_tokens, flat_weights):
  """The whole batch's masked mean as one loss_fn call over every sequence [M·B, S+1] (the
  definition the microbatched engines must reproduce, gradient included)."""
  return model_lib.loss_fn(CFG, params, flat_tokens, flat_weights)


# ------------------------------------------------------------------------------------------------
# The definition.
# ------------------------------------------------------------------------------------------------


def test_token_weights():
  mask = np.array([[[1, 1, 0, 0]], [[1, 0, 0, 0]]], np.uint8)  # M = 2, 3 learned tokens
  w = model_lib.token_weights(mask)
  assert w.dtype == np.float32
  np.testing.assert_array_equal(w, mask * np.float32(2 / 3))
  assert not model_lib.token_weights(np.zeros((2, 1, 4), np.uint8)).any()
  # All ones: M / (M·N) rounds to the unmasked path's 1/N.
  ones = model_lib.token_weights(np.ones((3, 2, 5), np.uint8))
  assert (ones == np.float32(1 / 10)).all()


@pytest.mark.parametrize('num_micro', [1, 3])
def test_masked_loss_and_gradient_equal_the_reference(num_micro):
  """The resident step's learning/loss is the float64 masked mean over all M microbatches, and
  its gradient (grad_clip off, via the update) is that of the whole batch's masked mean."""
  batch = masked_batches(num_micro)[0]
  params = _params()
  want = _reference_loss(params, batch.tokens, batch.loss_mask)
  # A mean of microbatch means would differ by far more than the tolerance.
  if num_micro > 1:
    means = [_reference_loss(params, batch.tokens[m], batch.loss_mask[m])
             for m in range(num_micro)]
    assert abs(np.mean(means) - want) > 1e-3

  loss_and_grad = jax.value_and_grad(lambda p, b, w=None: model_lib.loss_fn(CFG, p, b, w))
  weights = model_lib.token_weights(batch.loss_mask)
  loss, grads = jax.jit(lambda p, b, w: resident.accumulate_gradients(loss_and_grad, p, b, w))(
      params, batch.tokens, weights)
  assert abs(float(loss) - want) <= 1e-5 * want
  flat = batch.tokens.reshape(-1, batch.tokens.shape[-1])
  want_loss, want_grads = jax.jit(jax.value_and_grad(_masked_mean_loss))(
      params, flat, model_lib.token_weights(batch.loss_mask.reshape(flat.shape[0], -1)))
  np.testing.assert_allclose(float(want_loss), want, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b)

  tx, schedule, clip = make_tx(0.0)
  engine = resident.ResidentEngine(CFG, tx, schedule, clip, jax.tree.map(np.copy, initial_state()))
  got = float(engine.train_step(batch)['learning/loss'])
  assert abs(got - want) <= 1e-5 * want


def test_eval_loss_is_the_masked_mean_over_all_eval_batches():
  tx, schedule, clip = make_tx(1.0)
  engine = resident.ResidentEngine(CFG, tx, schedule, clip, jax.tree.map(np.copy, initial_state()))
  step = masked_batches(3)[1]
  evals = [Batch(step.tokens[m], step.loss_mask[m]) for m in range(3)]
  got = train._evaluate(engine, evals)['eval/loss']
  want = _reference_loss(_params(), step.tokens, step.loss_mask)
  assert abs(got - want) <= 1e-5 * want
  per_batch = engine.eval_losses(evals)
  for b, loss in zip(evals, per_batch):
    assert abs(loss - _reference_loss(_params(), b.tokens, b.loss_mask)) <= 1e-5 * loss


def test_a_validation_split_shorter_than_a_batch_is_evaluated_whole():
  """3 windows of a split, batch_size 4 (a small fine-tuning set's validation split): one
  batch of the 3 and a row that does not count; eval/loss is the mean over the 3 windows'
  targets exactly, in the resident and streamed engines alike."""
  tokens = np.random.default_rng(5).integers(0, CFG.vocab_size, 3 * 17 + 5).astype(np.uint16)
  evals = data_lib.eval_batches(tokens, seq_len=16, batch_size=4, num_batches=8)
  assert len(evals) == 1 and evals[0].tokens.shape == (4, 17)
  windows = tokens[:3 * 17].astype(np.int32).reshape(3, 17)
  want = _reference_loss(_params(), windows, np.ones((3, 16)))
  tx, schedule, clip = make_tx(1.0)
  for engine in (resident.ResidentEngine(CFG, tx, schedule, clip,
                                         jax.tree.map(np.copy, initial_state())),
                 StreamedEngine(CFG, tx, schedule, clip,
                                Placement(params='host', opt_state='host', layers_per_group=2),
                                jax.tree.map(np.copy, initial_state()))):
    assert train._evaluate(engine, evals)['eval/loss'] == pytest.approx(want, rel=1e-5)


def test_all_ones_mask_equals_the_unmasked_path():
  tx, schedule, clip = make_tx(1.0)
  plain = masked_batches(2)
  runs = []
  for wrap in (lambda b: b.tokens, lambda b: Batch(b.tokens, np.ones_like(b.loss_mask))):
    engine = resident.ResidentEngine(CFG, tx, schedule, clip,
                                     jax.tree.map(np.copy, initial_state()))
    losses = [float(engine.train_step(wrap(b))['learning/loss']) for b in plain]
    evals = engine.eval_losses([wrap(Batch(b.tokens[0], b.loss_mask[0])) for b in plain])
    runs.append((losses, evals, jax.tree.map(np.asarray, engine.export_state())))
  (want, want_eval, want_state), (got, got_eval, got_state) = runs
  np.testing.assert_allclose(got, want, rtol=1e-6)
  np.testing.assert_allclose(got_eval, want_eval, rtol=1e-6)
  assert_states_match(got_state, want_state)


def test_a_step_without_learned_tokens_is_zero_not_nan():
  """Loss 0 and zero gradients (the optimizer still steps: Adam's momentum and weight decay)."""
  tx, schedule, clip = make_tx(1.0)
  batch = masked_batches(2)[0]
  empty = Batch(batch.tokens, np.zeros_like(batch.loss_mask))
  res = resident.ResidentEngine(CFG, tx, schedule, clip, jax.tree.map(np.copy, initial_state()))
  streamed = StreamedEngine(CFG, tx, schedule, clip,
                            Placement(params='host', opt_state='host', layers_per_group=2),
                            jax.tree.map(np.copy, initial_state()))
  for engine in (res, streamed):
    metrics = engine.train_step(empty)
    assert float(metrics['learning/loss']) == 0.0 and float(metrics['learning/grad_norm']) == 0.0
    assert engine.eval_losses([Batch(empty.tokens[0], empty.loss_mask[0])]) == [0.0]
    state = jax.tree.map(np.asarray, engine.export_state())
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state['params']))
  assert_eval = train._evaluate(res, [Batch(empty.tokens[0], empty.loss_mask[0])])
  assert assert_eval['eval/loss'] == 0.0
  streamed.close()


# ------------------------------------------------------------------------------------------------
# Streamed = resident with masks.
# ------------------------------------------------------------------------------------------------


def _resident_masked(num_micro: int, grad_clip: float):
  tx, schedule, clip = make_tx(grad_clip)
  engine = resident.ResidentEngine(CFG, tx, schedule, clip, jax.tree.map(np.copy, initial_state()))
  losses = [float(engine.train_step(b)['learning/loss']) for b in masked_batches(num_micro)]
  evals = engine.eval_losses([Batch(b.tokens[-1], b.loss_mask[-1]) for b in masked_batches(2)])
  return losses, evals, jax.tree.map(np.asarray, engine.export_state())


@pytest.mark.parametrize('num_micro, placement', [
    (1, dict(params='host', opt_state='host')),
    (3, dict(params='host', opt_state='host', layers_per_group=2, optimizer_on='host')),
    (2, dict(params='nvme', opt_state='nvme', layers_per_group=2)),
    (2, dict(params='host', opt_state='host', embed_head='host', shard_mb=SHARD_MB)),
    (3, dict(params='nvme', opt_state='nvme', embed_head='nvme', shard_mb=SHARD_MB,
             layers_per_group=2)),
], ids=['host-M1', 'host-M3-host-optimizer', 'nvme-M2', 'embed-head-chunks-M2',
        'nvme-embed-head-chunks-M3'])
def test_streamed_matches_resident_with_masks(tmp_path, num_micro, placement):
  want, want_eval, want_state = _resident_masked(num_micro, 1.0)
  tx, schedule, clip = make_tx(1.0)
  placement = Placement(**placement, dir=str(tmp_path))
  placement.check(CFG)
  engine = StreamedEngine(CFG, tx, schedule, clip, placement,
                          jax.tree.map(np.copy, initial_state()))
  if placement.shard_mb == SHARD_MB:
    assert len(engine.vocab) == 4
  got = [float(engine.train_step(b)['learning/loss']) for b in masked_batches(num_micro)]
  got_eval = engine.eval_losses([Batch(b.tokens[-1], b.loss_mask[-1]) for b in masked_batches(2)])
  state = engine.export_state()
  engine.close()
  np.testing.assert_allclose(got, want, rtol=1e-6)
  np.testing.assert_allclose(got_eval, want_eval, rtol=1e-6)
  assert_states_match(state, want_state)


# ------------------------------------------------------------------------------------------------
# End to end: a prompt/completion JSONL with the byte tokenizer.
# ------------------------------------------------------------------------------------------------


def test_train_and_evaluate_on_prompt_completion_jsonl(tmp_path):
  rng = np.random.default_rng(0)
  words = ['alpha', 'beta', 'gamma', 'delta', 'omega', 'sigma']
  records = []
  for i in range(400):
    a, b = int(rng.integers(0, 50)), int(rng.integers(0, 50))
    records.append({'prompt': f'Q{i}: {words[i % 6]} {a}+{b}=', 'completion': f' {a + b}.'})
    if i % 5 == 0:
      records.append({'text': f'plain text {words[(i // 5) % 6]} number {i}.'})
  path = tmp_path / 'sft.jsonl'
  path.write_text(''.join(json.dumps(r) + '\n' for r in records))
  workdir = tmp_path / 'run'
  config = small_config(path, train__steps=4, train__eval_every=2, train__microbatches=2,
                        train__batch_size=4, checkpoint__every=2, data__val_fraction=0.2)
  last = train.train_and_evaluate(config, str(workdir))
  info, _ = data_lib.load_data(config.data, workdir)  # the prepared data, reused
  assert info.has_mask
  rows = read_rows(workdir)
  losses = [r['learning/loss'] for r in rows if 'learning/loss' in r]
  evals = [r['eval/loss'] for r in rows if 'eval/loss' in r]
  assert len(losses) == 4 and len(evals) == 3  # step 0 baseline, steps 2 and 4
  assert all(math.isfinite(x) and x > 0 for x in losses + evals)
  assert math.isfinite(last['learning/loss'])
  # Untrained, the masked loss is about log(vocab) (the byte model's 256 ids, model.vocab_size).
  assert abs(evals[0] - math.log(config.model.vocab_size)) < 1.5


def test_document_mask_takes_the_datas_eos(tmp_path):
  """model.document_mask: the run's model ends documents at the EOS its data stores
  (data.eos_token '~' here, byte 126, not the byte tokenizer's default NUL), in the engine and in
  the checkpoint's model config; the default run has no mask; --eval of the run applies it."""
  records = [{'text': f'record {i}: ' + 'xyz' * (i % 7)} for i in range(600)]
  path = tmp_path / 'docs.jsonl'
  path.write_text(''.join(json.dumps(r) + '\n' for r in records))
  config = small_config(path, train__steps=2, train__eval_every=0, checkpoint__every=2,
                        data__eos_token='~', model__document_mask=True)
  validate = train._validate  # pylint: disable=protected-access
  assert validate(config, str(tmp_path / 'run'))[0].document_eos_id == ord('~')
  last = train.train_and_evaluate(config, str(tmp_path / 'run'))
  assert math.isfinite(last['learning/loss'])
  meta = runs_lib.newest_checkpoint_meta(tmp_path / 'run')
  assert meta['model_config']['document_eos_id'] == ord('~')
  config.model.document_mask = False
  assert validate(config, str(tmp_path / 'other'))[0].document_eos_id == -1
  # --eval (and --sample) of the run read it with its mask unless the command line says not.
  config.eval.path, config.eval.max_len = str(path), 32
  assert train.evaluate(config, str(tmp_path / 'run'))['eval/document_mask']
  assert not train.evaluate(config, str(tmp_path / 'run'),
                            overrides=['model.document_mask'])['eval/document_mask']


def _documents_alone_loss(model_cfg, params, rows: list, eos: int) -> float:
  """Σ mask·nll / Σ mask over rows of (tokens [S+1], loss mask [S]), each document of a row run
  alone by model.forward (no document mask, its positions from 0), its targets scored from its
  own tokens only: the target after an EOS belongs to no document and is not scored."""
  forward = jax.jit(model_lib.forward, static_argnums=0)
  total = count = 0.0
  for tokens, mask in rows:
    ends = [i for i in range(len(tokens) - 1) if tokens[i] == eos] + [len(tokens) - 2]
    start = 0
    for end in ends:
      if end < start:
        continue
      piece = tokens[start:end + 1]  # the document's inputs, its EOS last (when in the row)
      logits = np.asarray(forward(model_cfg, params, jnp.asarray(piece[None])), np.float64)[0]
      logp = logits - logits.max(-1, keepdims=True)
      logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
      scored = np.arange(start, end + 1)
      scored = scored[(tokens[scored] != eos) & (mask[scored] != 0)]
      total -= logp[scored - start, tokens[scored + 1]].sum()
      count += scored.size
      start = end + 1
  return total / count


def test_document_mask_learns_and_scores_no_target_across_documents(tmp_path):
  """A run with model.document_mask on prompt/completion and text records (the byte tokenizer's
  EOS NUL after each): its first step's learning/loss and its step-0 eval/loss equal each
  document run alone through model.forward, scoring the learned targets inside documents only
  (not the first token of the next document, which its EOS input cannot see)."""
  records = []
  for i in range(300):
    records.append({'prompt': f'Q{i}: {i % 13}*3=', 'completion': f' {3 * (i % 13)}.'})
    if i % 3 == 0:
      records.append({'text': f'plain text number {i}, ' + 'ab' * (i % 5)})
  path = tmp_path / 'mixed.jsonl'
  path.write_text(''.join(json.dumps(r) + '\n' for r in records))
  workdir = tmp_path / 'run'
  config = small_config(path, train__steps=1, train__eval_every=0, train__microbatches=2,
                        train__batch_size=2, train__seq_len=48, train__eval_batches=2,
                        checkpoint__every=1, model__document_mask=True)
  last = train.train_and_evaluate(config, str(workdir))
  model_cfg = train._validate(config, str(workdir))[0]  # pylint: disable=protected-access
  assert model_cfg.document_eos_id == 0
  params = resident.init_state(model_cfg, make_tx(1.0)[0], config.train.seed)['params']
  plain = model_cfg.replace(document_eos_id=-1)

  info, _ = data_lib.load_data(config.data, workdir)
  sampler = data_lib.BatchSampler(data_lib.load_split(info, 'train'), seq_len=48, batch_size=2,
                                  microbatches=2, seed=config.train.seed, document_eos=0)
  batch = sampler.batch(0)
  stored = data_lib.BatchSampler(data_lib.load_split(info, 'train'), seq_len=48, batch_size=2,
                                 microbatches=2, seed=config.train.seed).batch(0)
  np.testing.assert_array_equal(batch.tokens, stored.tokens)
  after_eos = stored.tokens[..., :-1] == 0
  assert after_eos.any() and (stored.loss_mask == 0).any()  # both kinds of unlearned target
  np.testing.assert_array_equal(batch.loss_mask, stored.loss_mask * ~after_eos)
  rows = list(zip(batch.tokens.reshape(4, -1), stored.loss_mask.reshape(4, -1)))
  assert last['learning/loss'] == pytest.approx(_documents_alone_loss(plain, params, rows, 0),
                                                rel=1e-5)

  evals = data_lib.eval_batches(data_lib.load_split(info, 'val'), seq_len=48, batch_size=2,
                                num_batches=2)
  rows = [row for b in evals for row in zip(b.tokens, b.loss_mask)]
  baseline = read_rows(workdir)[0]
  assert baseline['step'] == 0
  assert baseline['eval/loss'] == pytest.approx(_documents_alone_loss(plain, params, rows, 0),
                                                rel=1e-5)


@pytest.mark.parametrize('strategy', ['documents', 'best_fit'])
def test_rows_of_whole_documents_train_each_prompt_with_its_answer(tmp_path, strategy, capsys):
  """data.pack='documents' or 'best_fit' with the document mask: a row holds whole
  prompt/completion records (none cut, so no answer is learned without its question), padding
  is not learned, and the first learning/loss equals each document run alone over its own
  learned targets."""
  records = [{'prompt': f'Question {i}: what is {i % 17} times 3?',
              'completion': f' {3 * (i % 17)}.'} for i in range(300)]
  path = tmp_path / 'sft.jsonl'
  path.write_text(''.join(json.dumps(r) + '\n' for r in records))
  workdir = tmp_path / 'run'
  config = small_config(path, train__steps=1, train__eval_every=0, train__microbatches=2,
                        train__batch_size=2, train__seq_len=48, train__eval_batches=2,
                        checkpoint__every=1, model__document_mask=True, data__pack=strategy)
  last = train.train_and_evaluate(config, str(workdir))
  assert 'without model.document_mask' not in capsys.readouterr().out
  model_cfg = train._validate(config, str(workdir))[0]  # pylint: disable=protected-access
  params = resident.init_state(model_cfg, make_tx(1.0)[0], config.train.seed)['params']
  info, _ = data_lib.load_data(config.data, workdir)
  stored = data_lib.BatchSampler(data_lib.load_split(info, 'train'), seq_len=48, batch_size=2,
                                 microbatches=2, seed=config.train.seed,
                                 row_packing=packing.RowPacking(strategy, 0)).batch(0)
  for row, mask in zip(stored.tokens.reshape(4, -1), stored.loss_mask.reshape(4, -1)):
    text = bytes(row.astype(np.uint8)).rstrip(b'\0').decode()
    assert text.startswith('Question') and text.count('Question') == text.count('?')
    assert mask[len(text):].sum() == 0  # the padding (EOS ids) is not learned
  rows = list(zip(stored.tokens.reshape(4, -1), stored.loss_mask.reshape(4, -1)))
  want = _documents_alone_loss(model_cfg.replace(document_eos_id=-1), params, rows, 0)
  assert last['learning/loss'] == pytest.approx(want, rel=1e-5)
  # data/*: the share of the step's targets learned (padding, prompts and each document's first
  # target are not), and the epochs its 4 samples make.
  sampler = data_lib.BatchSampler(data_lib.load_split(info, 'train'), seq_len=48, batch_size=2,
                                  microbatches=2, seed=config.train.seed, document_eos=0,
                                  row_packing=packing.RowPacking(strategy, 0))
  assert last['data/learned_fraction'] == pytest.approx(sampler.batch(0).loss_mask.mean())
  assert 0 < last['data/learned_fraction'] < 0.5  # short answers to longer questions
  assert last['data/epoch'] == pytest.approx(4 / sampler.n_windows)
  if strategy == 'best_fit':  # without the document mask the run says what that means
    unmasked = small_config(path, train__steps=1, train__eval_every=0, train__eval_batches=2,
                            train__batch_size=2, train__seq_len=48, checkpoint__every=0,
                            data__pack=strategy)
    train.train_and_evaluate(unmasked, str(tmp_path / 'unmasked'))
    assert "note: data.pack='best_fit' without model.document_mask" in capsys.readouterr().out
