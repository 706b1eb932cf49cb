"""eval.path takes every format data.path takes (issue 12): text, JSONL (plain, zstd, gzip),
Parquet, directories and globs, read by the data package's readers; record files become
documents as training stores them ([BOS] tokens EOS), and prompt/completion records score only
their completions. A .jsonl eval file gives the eval/loss of the equivalent token stream."""

import contextlib
import errno
import gzip
import json
import os
import pathlib
import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from megatrain_jax import config as config_lib
from megatrain_jax import evaluate as evaluate_lib
from megatrain_jax import fs
from megatrain_jax import export as export_lib
from megatrain_jax import locks
from megatrain_jax import model as model_lib
from megatrain_jax import partition
from megatrain_jax import train
from megatrain_jax.checkpoint import Checkpointer
from megatrain_jax.data import ByteTokenizer
from megatrain_jax.errors import ConfigError, DiskFullError

from helpers import AS_ROOT, fill, read_only_directory, small_config, tmpfs

DOCS = ['The first document.', 'A second one, a little longer than the first.',
        'Third: unicode é ü 東京.', 'and the last']
EOS = 0  # the byte tokenizer's EOS (NUL)


def _stream(docs) -> np.ndarray:
  """Each document's bytes then EOS: the token stream training would store."""
  return np.array([t for d in docs for t in list(d.encode('utf-8')) + [EOS]], np.int32)


def _jsonl(records) -> bytes:
  return ''.join(json.dumps(r) + '\n' for r in records).encode()


def _write_formats(directory):
  """The same documents as .jsonl, .jsonl.gz, .jsonl.zst, .parquet and .arrow (IPC stream)."""
  directory.mkdir(parents=True, exist_ok=True)
  data = _jsonl([{'text': d} for d in DOCS])
  (directory / 'a.jsonl').write_bytes(data)
  (directory / 'b.jsonl.gz').write_bytes(gzip.compress(data))
  (directory / 'c.jsonl.zst').write_bytes(zstandard.ZstdCompressor().compress(data))
  pq.write_table(pa.table({'text': DOCS}), directory / 'd.parquet', row_group_size=3)
  with pa.OSFile(str(directory / 'e.arrow'), 'wb') as sink, \
      pa.ipc.new_stream(sink, pa.schema([('text', pa.string())])) as writer:
    writer.write_table(pa.table({'text': DOCS}), max_chunksize=2)
  return directory


def test_every_format_reads_as_the_documents_stream(tmp_path):
  files = _write_formats(tmp_path / 'src')
  tok = ByteTokenizer()
  want = _stream(DOCS)
  for name in ('a.jsonl', 'b.jsonl.gz', 'c.jsonl.zst', 'd.parquet', 'e.arrow'):
    tokens, mask, _ = evaluate_lib.read_eval_data(str(files / name), tok)
    np.testing.assert_array_equal(tokens, want)
    assert mask is None
  # A directory and a glob: the files in sorted order, one stream.
  tokens, _, _ = evaluate_lib.read_eval_data(str(files), tok)
  np.testing.assert_array_equal(tokens, np.tile(want, 5))
  tokens, _, _ = evaluate_lib.read_eval_data(str(files / '*.jsonl*'), tok)
  np.testing.assert_array_equal(tokens, np.tile(want, 3))
  # A text file stays one stream tokenized whole, no EOS (as before).
  (tmp_path / 'plain.txt').write_text('hello\nworld\n')
  tokens, mask, _ = evaluate_lib.read_eval_data(str(tmp_path / 'plain.txt'), tok)
  np.testing.assert_array_equal(tokens, np.frombuffer(b'hello\nworld\n', np.uint8))
  assert mask is None


def test_prompt_completion_records_score_only_completions(tmp_path):
  path = tmp_path / 'sft.jsonl'
  path.write_bytes(_jsonl([{'prompt': 'Q: 2+2?', 'completion': ' 4'}, {'text': 'xy'},
                           {'prompt': 'Hi', 'completion': '!'}]))
  tokens, mask, _ = evaluate_lib.read_eval_data(str(path), ByteTokenizer())
  np.testing.assert_array_equal(tokens, _stream(['Q: 2+2? 4', 'xy', 'Hi!']))
  np.testing.assert_array_equal(mask, [0] * 7 + [1, 1, 1] + [1, 1, 1] + [0, 0, 1, 1])
  # Only the marked targets are scored (and a window's first token is context, never a target).
  chosen = evaluate_lib.windows(tokens.size, 6, 6)
  _, scored, _ = evaluate_lib.batch_windows(tokens, chosen[:2], 6, 2, mask)
  np.testing.assert_array_equal(scored[0], mask[1:7])
  np.testing.assert_array_equal(scored[1], mask[7:13])


@pytest.mark.parametrize('path, error', [
    ('missing.jsonl', 'eval.path: .*missing.jsonl does not exist'),
    ('bad.jsonl', r'eval.path: bad record .*bad.jsonl:2: malformed JSON'),
    ('empty.jsonl', 'eval.path: .*empty.jsonl has 0 token'),
])
def test_bad_eval_files(tmp_path, path, error):
  (tmp_path / 'bad.jsonl').write_text('{"text": "ok"}\n{"text": \n')
  (tmp_path / 'empty.jsonl').write_text('\n')
  with pytest.raises(ConfigError, match=error):
    evaluate_lib.read_eval_data(str(tmp_path / path), ByteTokenizer())


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """A workdir with a checkpoint of a small byte model (one step on the embedded corpus)."""
  workdir = tmp_path_factory.mktemp('run')
  config = small_config('', train__steps=1, checkpoint__every=1, train__eval_every=0,
                        train__batch_size=2, train__seq_len=32)
  train.train_and_evaluate(config, str(workdir))
  return config, workdir


def _direct_perplexity(config, workdir, tokens, mask=None):
  """perplexity() of a token stream straight from the run's checkpoint (no eval.path)."""
  model_cfg = config_lib.validate(config)
  reader = Checkpointer(workdir, keep=2).restore(model_cfg)
  evaluator = evaluate_lib.Evaluator(
      reader, model_cfg, [(0, model_cfg.num_layers)],
      partition.vocab_slices(model_cfg.vocab_size, model_cfg.d_model, config.offload.shard_mb))
  try:
    return evaluate_lib.perplexity(evaluator, tokens, 16, 8, 3, progress=False, mask=mask)
  finally:
    evaluator.close()


class _Bar:
  """A stand-in for metrics.progress_bar's tqdm: records bar.n at each update, and whether a
  pass (`Evaluator.nll_sums`) was running then."""

  def __init__(self, total, passing):
    self.total, self.n, self.disable, self.passing, self.seen = total, 0, False, passing, []

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False

  def update(self, count):
    self.n += count
    self.seen.append((self.n, self.passing[0]))


def test_eval_progress_advances_within_a_pass(trained, monkeypatch):
  """All windows in one pass (layer-major): the bar must move as each embedding chunk, layer
  group and head chunk is done, not sit at 0 until the pass ends; the loss is unchanged."""
  config, workdir = trained
  model_cfg = config_lib.validate(config)
  reader = Checkpointer(workdir, keep=2).restore(model_cfg)
  evaluator = evaluate_lib.Evaluator(
      reader, model_cfg, [(i, i + 1) for i in range(model_cfg.num_layers)],
      partition.vocab_slices(model_cfg.vocab_size, model_cfg.d_model, 0.02))  # 4 chunks
  tokens = _stream(DOCS * 4)  # [432] tokens: 27 windows of 16, one pass of 9 batches of 3
  want = evaluate_lib.perplexity(evaluator, tokens, 16, 16, 3, progress=False)
  passing, bars, passes, nll_sums = [False], [], [], evaluator.nll_sums

  def one_pass(*args):
    passing[0] = True
    passes.append(len(args[0]))
    try:
      return nll_sums(*args)
    finally:
      passing[0] = False

  monkeypatch.setattr(evaluator, 'nll_sums', one_pass)
  monkeypatch.setattr(evaluate_lib.metrics, 'progress_bar',
                      lambda total, *_, **__: bars.append(_Bar(total, passing)) or bars[-1])
  try:
    got = evaluate_lib.perplexity(evaluator, tokens, 16, 16, 3)
  finally:
    evaluator.close()
  (bar,) = bars
  windows = got['eval/windows']
  assert passes == [9]  # every window in one pass
  within = [n for n, inside in bar.seen if inside and 0 < n < windows]
  assert len(set(within)) >= model_cfg.num_layers, bar.seen  # several steps within the pass
  assert [n for n, _ in bar.seen] == sorted(n for n, _ in bar.seen)
  assert bar.n == windows == 27
  assert got['eval/loss'] == want['eval/loss']


def test_jsonl_eval_equals_the_token_stream(trained, tmp_path):
  config, workdir = trained
  files = _write_formats(tmp_path / 'src')
  want = _direct_perplexity(config, workdir, _stream(DOCS))
  for name in ('a.jsonl', 'c.jsonl.zst', 'd.parquet'):
    config.eval.path, config.eval.max_len, config.eval.stride = str(files / name), 16, 8
    config.eval.batch_size = 3
    got = train.evaluate(config, str(workdir))
    assert got['eval/tokens'] == want['eval/tokens'] == _stream(DOCS).size - 1
    assert got['eval/loss'] == pytest.approx(want['eval/loss'], rel=1e-6), name


def test_prompt_completion_eval_scores_the_completions(trained, tmp_path):
  config, workdir = trained
  path = tmp_path / 'sft.jsonl'
  records = [{'prompt': f'Question {i}?', 'completion': f' answer {i * 7}.'} for i in range(6)]
  path.write_bytes(_jsonl(records))
  config.eval.path, config.eval.max_len, config.eval.stride, config.eval.batch_size = (
      str(path), 16, 8, 3)
  got = train.evaluate(config, str(workdir))
  tokens = _stream([r['prompt'] + r['completion'] for r in records])
  mask = np.concatenate([[0] * len(r['prompt']) + [1] * (len(r['completion']) + 1)
                         for r in records]).astype(np.uint8)
  assert got['eval/tokens'] == int(mask[1:].sum())
  want = _direct_perplexity(config, workdir, tokens, mask)
  assert got['eval/loss'] == pytest.approx(want['eval/loss'], rel=1e-6)
  everything = _direct_perplexity(config, workdir, tokens)
  assert everything['eval/tokens'] == tokens.size - 1 > got['eval/tokens']


def test_document_mask_eval_scores_each_document_in_its_own_context(trained, tmp_path):
  """--eval with model.document_mask: the evaluator's positions and segments come from each
  window's EOS (the byte tokenizer's NUL here), giving the loss of model.forward with the mask on
  the checkpoint's params over every target but the first token of each later document (its
  EOS input sees only the document before: training does not learn it either); without the mask
  the documents see each other and every target is scored (another loss)."""
  config, workdir = trained
  config = config.copy_and_resolve_references()
  (tmp_path / 'docs.jsonl').write_bytes(_jsonl([{'text': d} for d in DOCS]))
  stream = _stream(DOCS)
  config.eval.path, config.eval.max_len = str(tmp_path / 'docs.jsonl'), stream.size - 1
  config.eval.stride, config.eval.batch_size = stream.size - 1, 1  # one window: the whole stream
  config.model.document_mask = True
  got = train.evaluate(config, str(workdir))
  after_eos = stream[:-1] == EOS  # the targets not scored: one per document but the last
  assert after_eos.sum() == len(DOCS) - 1
  assert got['eval/windows'] == 1 and got['eval/tokens'] == stream.size - 1 - after_eos.sum()

  model_cfg = config_lib.validate(config).replace(document_eos_id=EOS)
  reader = Checkpointer(workdir, keep=2).restore(model_cfg)
  params = reader.full_state({'params': model_lib.abstract_params(model_cfg)})['params']
  logits = model_lib.forward(model_cfg, params, jnp.asarray(stream[None, :-1]))
  nll = -jnp.take_along_axis(jax.nn.log_softmax(logits[0]), jnp.asarray(stream[1:, None]), -1)
  assert got['eval/loss'] == pytest.approx(float(jnp.mean(nll[~after_eos])), rel=1e-5)

  config.model.document_mask = False
  unmasked = train.evaluate(config, str(workdir))
  assert unmasked['eval/tokens'] == stream.size - 1
  assert abs(unmasked['eval/loss'] - got['eval/loss']) > 1e-3


def test_eval_sample_and_export_read_a_run_that_is_training(trained, tmp_path):
  """--eval, --sample and --export_hf take no workdir lock: they run while the run's own lock is
  held (a run training there), each holding only the checkpoint it reads
  (checkpoint.read_checkpoint, tests/test_checkpoint.py); a second training run is still
  refused."""
  config, workdir = trained
  config = config.copy_and_resolve_references()
  (tmp_path / 'eval.txt').write_text('Some text to score while the run trains. ' * 8)
  config.eval.path, config.eval.max_len = str(tmp_path / 'eval.txt'), 32
  config.sample.prompt, config.sample.max_new_tokens = 'The ', 4
  with locks.hold_workdir(workdir):
    assert train.evaluate(config, str(workdir))['eval/tokens'] > 0
    assert train.sample(config, str(workdir))['sample/tokens'] >= 1
    files = train.export_hf(config, str(workdir), str(tmp_path / 'hf'))
    assert any(f.name.endswith('.safetensors') for f in files)
    with pytest.raises(locks.DirectoryInUseError):  # a second training run is still refused
      train.train_and_evaluate(config, str(workdir))


@contextlib.contextmanager
def _read_only_view(directory: pathlib.Path, view: pathlib.Path):
  """`directory` as a read-only tree at `view`: a read-only bind mount as root (root ignores mode
  bits), else a copy with every directory mode 0555."""
  if os.geteuid() == 0:
    view.mkdir()
    subprocess.run(['mount', '--bind', str(directory), str(view)], check=True)
    try:
      subprocess.run(['mount', '-o', 'remount,bind,ro', str(view)], check=True)
      yield view
    finally:
      subprocess.run(['umount', str(view)], check=True)
    return
  shutil.copytree(directory, view)
  dirs = [view, *(p for p in view.rglob('*') if p.is_dir())]
  for d in dirs:
    d.chmod(0o555)
  try:
    yield view
  finally:
    for d in dirs:
      d.chmod(0o755)


def test_sample_and_export_read_a_run_they_cannot_write_to(trained, tmp_path):
  """A teammate's run, or a read-only mount: --sample and --export_hf write nothing into the
  workdir, so they read it (both refused it as not writable); --eval, which writes eval.json
  there, is refused saying so, before it reads anything."""
  config, workdir = trained
  config = config.copy_and_resolve_references()
  config.sample.prompt, config.sample.max_new_tokens = 'The ', 4
  (tmp_path / 'eval.txt').write_text('Some text to score. ' * 8)
  config.eval.path, config.eval.max_len = str(tmp_path / 'eval.txt'), 32
  with _read_only_view(workdir, tmp_path / 'ro') as view:
    with pytest.raises(OSError):
      (view / 'probe').write_text('')
    before = sorted(p.relative_to(view) for p in view.rglob('*'))
    assert train.sample(config, str(view))['sample/tokens'] >= 1
    files = train.export_hf(config, str(view), str(tmp_path / 'hf'))
    assert any(f.name.endswith('.safetensors') for f in files)
    with pytest.raises(ConfigError, match=r'is (not writable|on a read-only filesystem) \(--eval '
                                          r'writes eval.json there\)\. To evaluate a run you '
                                          r'cannot write to, export it \(--export_hf=<dir>\) and '
                                          r'run --eval with --config.init.from_hf=<dir>'):
      train.evaluate(config, str(view))
    assert sorted(p.relative_to(view) for p in view.rglob('*')) == before


def _eval_config(config, tmp_path):
  config = config.copy_and_resolve_references()
  (tmp_path / 'eval.txt').write_text('Some text to score. ' * 8)
  config.eval.path, config.eval.max_len = str(tmp_path / 'eval.txt'), 32
  return config


@AS_ROOT
def test_eval_checks_its_workdir_has_room_before_it_evaluates(trained, tmp_path, monkeypatch):
  """--eval on a full disk computed the whole evaluation, then failed writing eval.json: it is
  refused before anything is read, with the bytes and the way out."""
  config, workdir = trained
  config = _eval_config(config, tmp_path)
  monkeypatch.setattr(evaluate_lib, 'perplexity', lambda *args, **kwargs: pytest.fail('ran'))
  with tmpfs(16) as disk:
    shutil.copytree(workdir, disk / 'run')
    ballast = fill(disk, leave_bytes=256 << 10)
    with pytest.raises(ConfigError, match=r"--workdir=.*: --eval's eval.json needs 1\.05 MB in "
                                          r'.*/run, and 0\.\d+ MB are free there\. Free space '
                                          r'there, or to evaluate a run you cannot write to'):
      train.evaluate(config, str(disk / 'run'))
    ballast.unlink()


def test_an_eval_result_is_printed_before_a_full_disk_loses_it(trained, tmp_path, monkeypatch,
                                                               capsys):
  """The disk filling during the evaluation: the result is printed first (it was printed only
  after eval.json was written, so a full disk lost it), then one line says what was not
  written."""
  config, workdir = trained
  config = _eval_config(config, tmp_path)

  def full(path, obj):
    raise OSError(errno.ENOSPC, 'No space left on device')

  monkeypatch.setattr(fs, 'write_json_atomic', full)
  with pytest.raises(DiskFullError, match=rf'--eval: the disk of {workdir} is full \(No space left '
                                          r'on device\): eval.json and evals.jsonl were not '
                                          r'written; the result printed above is the'):
    train.evaluate(config, str(workdir))
  assert re.search(r'eval/loss \d+\.\d{6} \| eval/perplexity', capsys.readouterr().out)


@AS_ROOT
def test_an_export_checks_its_destination_and_cleans_up_after_a_full_disk(trained, tmp_path,
                                                                         monkeypatch):
  """--export_hf to a full disk named the source run's disk and left its part-written staging
  directory filling the destination's; to a read-only one it was an OSError's traceback. Both
  are refused before anything is read, naming the destination; a disk that fills meanwhile is
  one line naming it, with nothing left behind."""
  config, workdir = trained
  model_cfg = config_lib.validate(config)
  needed = export_lib.export_bytes(model_cfg)
  assert needed == 4 * model_cfg.num_params + (1 << 20)
  with read_only_directory() as locked:
    with pytest.raises(ConfigError, match=rf'--export_hf={locked}/hf: {locked} is (not writable|on '
                                          r'a read-only filesystem)\. Export to a directory on a '
                                          'disk you can write to'):
      train.export_hf(config, str(workdir), str(locked / 'hf'))
  with tmpfs(4) as disk:
    ballast = fill(disk, leave_bytes=2 * model_cfg.num_params)  # half the weights
    with pytest.raises(ConfigError, match=rf'--export_hf={disk}/hf: the export needs '
                                          rf'{needed / 1e6:.2f} MB in {disk}, and 0\.\d+ MB are '
                                          r'free there\. Free space there, or export to'):
      train.export_hf(config, str(workdir), str(disk / 'hf'))
    monkeypatch.setattr(export_lib, 'export_bytes', lambda *args: 0)  # past the check
    with pytest.raises(DiskFullError, match=rf'--export_hf: the disk of {disk}/hf is full \(No '
                                            r'space left on device\); the partial export was '
                                            'removed'):
      train.export_hf(config, str(workdir), str(disk / 'hf'))
    assert os.listdir(disk) == ['ballast']
    ballast.unlink()


def test_sample_checks_sample_out_before_it_generates(trained, tmp_path, monkeypatch, capsys):
  """--sample with sample.prompts: a sample.out on a read-only or full disk failed once every
  prompt was continued (the workdir's disk named, or a traceback), the continuations lost. It is
  refused before generating; a write that fails still prints the JSON lines, naming sample.out."""
  config, workdir = trained
  config = config.copy_and_resolve_references()
  (tmp_path / 'prompts.txt').write_text('The \nA \n')
  config.sample.prompts, config.sample.max_new_tokens = str(tmp_path / 'prompts.txt'), 4
  generate_all = train.sample_lib.generate_all
  monkeypatch.setattr(train.sample_lib, 'generate_all', lambda *a, **k: pytest.fail('generated'))
  with read_only_directory() as locked:
    config.sample.out = str(locked / 'out.jsonl')
    with pytest.raises(ConfigError, match=rf"sample.out='{locked}/out.jsonl': {locked} is (not "
                                          r'writable|on a read-only filesystem)\. Write it '
                                          'elsewhere'):
      train.sample(config, str(workdir))
  monkeypatch.setattr(train.sample_lib, 'generate_all', generate_all)

  def full(path, text):
    raise OSError(errno.ENOSPC, 'No space left on device')

  monkeypatch.setattr(fs, 'write_text_atomic', full)
  config.sample.out = str(tmp_path / 'out.jsonl')
  with pytest.raises(DiskFullError, match=rf"sample.out='{tmp_path}/out.jsonl': {tmp_path}/out"
                                          r'.jsonl could not be written \(No space left on '
                                          r'device\); its JSON lines are printed above'):
    train.sample(config, str(workdir))
  printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()
             if line.startswith('{')]
  assert [row['prompt'] for row in printed] == ['The ', 'A ']


def test_an_export_killed_midway_leaves_nothing_to_load_at_its_destination(trained, tmp_path,
                                                                            monkeypatch):
  """--export_hf writes into a hidden directory inside the destination and moves the files out of
  it at the end, config.json last: an export that dies after its first shard leaves only that
  hidden directory (no config.json for from_pretrained to start from), and the rerun replaces the
  leftover and writes every file."""
  config, workdir = trained
  config = config.copy_and_resolve_references()
  config.export.max_shard_gb = 2e-5  # several shards
  out = tmp_path / 'hf'
  write_shard = export_lib._write_shard  # pylint: disable=protected-access
  shards = []

  def dies_after_one(*args):
    if shards:
      raise KeyboardInterrupt('killed')
    shards.append(write_shard(*args))

  monkeypatch.setattr(export_lib, '_write_shard', dies_after_one)
  with pytest.raises(KeyboardInterrupt):
    train.export_hf(config, str(workdir), str(out))
  assert [p.name for p in out.iterdir()] == ['.export-tmp']
  monkeypatch.setattr(export_lib, '_write_shard', write_shard)
  files = train.export_hf(config, str(workdir), str(out))
  assert len([f for f in files if f.suffix == '.safetensors']) > 1
  assert sorted(p.name for p in out.iterdir()) == sorted(f.name for f in files)
  assert [p.name for p in tmp_path.iterdir()] == ['hf']


def test_an_export_into_a_directory_someone_made_keeps_it(trained, tmp_path):
  """Destinations users make for an export: a directory whose mode and owner are set (a rename
  over it replaced it: setgid and a private mode gone), a symlink to one (renaming onto the link
  failed after all the writing), a git clone of a Hub repository (.git and .gitattributes only:
  refused as not empty). The export lands in each, which keeps what it was and held."""
  config, workdir = trained
  shared = tmp_path / 'shared'
  shared.mkdir()
  os.chmod(shared, 0o2770)
  inode = shared.stat().st_ino
  files = train.export_hf(config, str(workdir), str(shared))
  assert (shared.stat().st_ino, shared.stat().st_mode & 0o7777) == (inode, 0o2770)
  assert sorted(p.name for p in shared.iterdir()) == sorted(f.name for f in files)
  (tmp_path / 'target').mkdir()
  (tmp_path / 'link').symlink_to(tmp_path / 'target')
  train.export_hf(config, str(workdir), str(tmp_path / 'link'))
  assert (tmp_path / 'link').is_symlink() and (tmp_path / 'target' / 'config.json').is_file()
  clone = tmp_path / 'clone'
  (clone / '.git').mkdir(parents=True)
  (clone / '.gitattributes').write_text('*.safetensors filter=lfs diff=lfs merge=lfs -text\n')
  train.export_hf(config, str(workdir), str(clone))
  assert {'.git', '.gitattributes', 'config.json'} <= {p.name for p in clone.iterdir()}
  with pytest.raises(ConfigError, match='is not empty; exporting there would mix two'):
    train.export_hf(config, str(workdir), str(clone))


def test_a_second_export_into_the_same_directory_at_once_is_refused(trained, tmp_path):
  """Two exports into one directory at once published a mix of both runs' shards (each file whole,
  so transformers loaded it without a word): an export holds a lock on its destination, and a
  second one is refused before it writes anything."""
  config, workdir = trained
  out = tmp_path / 'hf'
  out.mkdir()
  with locks.hold_export(out):  # the first export, writing
    with pytest.raises(locks.DirectoryInUseError, match=rf'--export_hf: {out} is being written by '
                                                        'another export: wait for it'):
      train.export_hf(config, str(workdir), str(out))
    assert not any(out.iterdir())
  assert (out / 'config.json') in train.export_hf(config, str(workdir), str(out))


@AS_ROOT
def test_an_export_onto_a_mount_point(trained):
  """A container's volume (`docker run -v host/out:/out ... --export_hf=/out`): an empty mount
  point, which no rename can replace (EBUSY after all the writing, the whole export left on the
  parent's disk). The export lands on the mounted disk."""
  config, workdir = trained
  with tmpfs(8) as disk:
    files = train.export_hf(config, str(workdir), str(disk))
    assert sorted(p.name for p in disk.iterdir()) == sorted(f.name for f in files)


def test_windows_run_fewer_per_call_to_fit_the_working_limit_with_the_same_loss(trained):
  """A batch whose forward would compute in more than the evaluator's working limit runs a few
  windows per call (EvalMemory.rows), down to one: the same loss, and one call's working set
  within the limit."""
  config, workdir = trained
  model_cfg = config_lib.validate(config)
  vocab = partition.vocab_slices(model_cfg.vocab_size, model_cfg.d_model, 0.02)
  tokens = _stream(DOCS * 4)  # 27 windows of 16
  per_row = evaluate_lib.call_working_bytes(model_cfg, 1, 16, max(b - a for a, b in vocab))
  results = {}
  for working, rows in ((1 << 30, 9), (int(2.5 * per_row), 2), (1, 1)):
    reader = Checkpointer(workdir, keep=2).restore(model_cfg)
    evaluator = evaluate_lib.Evaluator(reader, model_cfg, [(0, model_cfg.num_layers)], vocab,
                                       working_bytes=working)
    try:
      memory = evaluator.memory(16, 9, num_windows=27)
      assert memory.rows == rows
      assert memory.working == evaluate_lib.call_working_bytes(model_cfg, rows, 16, vocab[0][1])
      assert memory.working <= max(working, per_row)
      assert memory.windows_per_pass % rows == 0
      results[rows] = evaluate_lib.perplexity(evaluator, tokens, 16, 16, 9, progress=False)
    finally:
      evaluator.close()
  assert results[1]['eval/tokens'] == results[9]['eval/tokens'] == tokens.size - 1
  for rows in (2, 1):
    assert results[rows]['eval/loss'] == pytest.approx(results[9]['eval/loss'], rel=1e-6)
  # A short evaluation pays for no padding rows: 3 windows asked for 9 per call run 3.
  assert evaluator.memory(16, 9, num_windows=3).rows == 1  # (the last evaluator's limit: 1 B)
  reader = Checkpointer(workdir, keep=2).restore(model_cfg)
  roomy = evaluate_lib.Evaluator(reader, model_cfg, [(0, model_cfg.num_layers)], vocab)
  assert roomy.memory(16, 9, num_windows=3).rows == 3
  roomy.close()


def test_an_eval_the_device_cannot_hold_is_refused_before_it_reads(trained, tmp_path,
                                                                     monkeypatch):
  config, workdir = trained
  config = config.copy_and_resolve_references()  # the module's runs share `trained`'s
  path = tmp_path / 'text.txt'
  path.write_text(' '.join(DOCS * 4))
  config.eval.path, config.eval.max_len, config.eval.batch_size = str(path), 32, 4
  config.offload.device_memory_gb = 1e-4  # 100 kB of device memory
  reads = []
  monkeypatch.setattr(evaluate_lib, '_read_piece', lambda *a: reads.append(a))
  (workdir / 'eval.json').unlink(missing_ok=True)
  with pytest.raises(ConfigError, match=r'eval.max_len=32 .* Lower eval.max_len'):
    train.evaluate(config, str(workdir))
  assert not reads and not (workdir / 'eval.json').exists()


class _NanReader:
  """A checkpoint reader whose leaf `key` holds NaN (a diverged run's last save)."""

  def __init__(self, reader, key):
    self.reader, self.key = reader, key

  def __getattr__(self, name):
    return getattr(self.reader, name)

  def read(self, path, *args, **kwargs):
    out = np.array(self.reader.read(path, *args, **kwargs))
    if path == self.key:
      out.reshape(-1)[::7] = np.nan
    return out


def test_eval_of_weights_holding_nan_names_the_tensors(trained):
  """--eval of a checkpoint whose params hold NaN printed 'perplexity nan' as a result, with no
  word of why: where a pass's loss is not finite, the weights are read once more and the
  tensors holding NaN or inf are named in a TrainingDivergedError (finite weights pay
  nothing)."""
  from megatrain_jax.errors import TrainingDivergedError  # pylint: disable=import-outside-toplevel
  config, workdir = trained
  model_cfg = config_lib.validate(config)
  key = "['params']['layers']['mlp']['down_proj']['kernel']"
  reader = Checkpointer(workdir, keep=2).restore(model_cfg)
  evaluator = evaluate_lib.Evaluator(
      _NanReader(reader, key), model_cfg, [(0, 1), (1, model_cfg.num_layers)],
      partition.vocab_slices(model_cfg.vocab_size, model_cfg.d_model, config.offload.shard_mb))
  try:
    with pytest.raises(TrainingDivergedError, match=re.escape(key) + r' \(layers 0:1\): [\d,]+ of '
                       r'[\d,]+ values; .*\(layers 1:\d+\).*evaluate an earlier checkpoint'):
      evaluate_lib.perplexity(evaluator, _stream(DOCS), 16, 8, 3, progress=False)
  finally:
    evaluator.close()
  assert _direct_perplexity(config, workdir, _stream(DOCS))['eval/loss'] > 0  # finite: no error
