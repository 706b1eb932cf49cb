"""Perplexity of a model on a token stream, with sliding windows (`launch.py --eval`).

The definition (the one of Hugging Face's perplexity guide, with the window's first token as
context rather than lost): the text is tokenized as one stream t[0..N). Window w starts at token
b = w·stride and feeds the model inputs t[b : b + max_len] (positions 0..max_len-1), predicting
t[b+1 : b+max_len+1]. Every token from position 1 on is scored exactly once, in the first window
that predicts it, given that window's tokens before it; so with stride = max_len the windows do not
overlap and each token is scored with 0..max_len-1 tokens of context, and a smaller stride scores
each token (after the first window) with at least max_len - stride of them.
    loss = (1/T) Σ_scored -log p(t_i | context),  perplexity = exp(loss),  T = N - 1.

eval.path takes what data.path takes (data/formats.py): a file, a directory (its non-hidden files,
sorted) or a glob pattern of .txt (or any other text), .jsonl(.zst/.gz), .parquet and .arrow.
The files are read in order into one stream. A text file is tokenized whole, as the perplexity
guide's `tokenizer(text)` tokenizes it: no EOS, and the tokenizer's BOS first where it adds one
(Llama's; not GPT-2's or Qwen's), once, at the start of the stream, so that every token of the
text is scored. Record files are read by the data
package's readers, each record one document stored as training stores it ([BOS] tokens EOS,
data/documents.py, with data.text_field / prompt_field / completion_field / eos_token). Where
records carry a loss mask (prompt/completion or chat records), only the targets training learns
are scored: T counts those, and the other targets are context only.

Forward only, whatever the placement: the weights come straight from a reader (the run's
checkpoint, `checkpoint.CheckpointReader`, or a Hugging Face directory, `hf.HfReader`), one layer
group or vocabulary chunk at a time, read ahead on a thread; Adam state is never read. Windows are
batched and run layer-major in passes (each pass reads the weights once for all its batches, as
the streamed engine's evaluation does); the LM head runs chunk by chunk with the online logsumexp
of model/head_chunks.py, so no [B, S, V] logits exist. The arithmetic is the engines' (the same
model functions), so the loss equals what training's eval/loss would give for the same tokens.
The progress bar counts windows and moves within a pass (one pass may hold them all), by each
piece's share of the pass (its parameter count) as the piece is computed.
"""

import concurrent.futures
import dataclasses
import functools
import math
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax import metrics
from megatrain_jax import model as model_lib
from megatrain_jax import partition
from megatrain_jax import schedule
from megatrain_jax.data import added_bos, data_format, document_format, unlearn_starts
from megatrain_jax.data import formats
from megatrain_jax.data.tokenizer import encode_text
from megatrain_jax.errors import ConfigError, TrainingDivergedError
from megatrain_jax.model import head_chunks
from megatrain_jax.prefetch import Prefetcher

PASS_BYTES = 1 << 30  # hidden states of the windows in one pass (compute dtype, [S, D] each)
# What one forward call may work in by default (eval.working_gb): a layer's temporaries or a head
# chunk's logits grow with the windows per call, and past a few thousand tokens per call the
# matmuls are already as fast per token as they get; at Qwen2's 151,936 ids and 32 windows of
# 2048 tokens the head chunks alone made a 0.67 GB model's evaluation peak at 7.5 GB.
WORKING_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class Window:
  """Inputs t[begin : begin + max_len]; the targets scored here are t[first : end]."""
  begin: int
  first: int
  end: int


def windows(num_tokens: int, max_len: int, stride: int) -> list[Window]:
  """The windows over a stream of `num_tokens` tokens (see the module docstring)."""
  if not 0 < stride <= max_len:
    raise ValueError(f'stride={stride} must be in [1, max_len={max_len}]')
  out, scored, begin = [], 1, 0
  while scored < num_tokens:
    end = min(begin + max_len + 1, num_tokens)
    out.append(Window(begin, scored, end))
    scored, begin = end, begin + stride
  return out


_FIELD = 'eval.path'


def _text_tokens(file: Path, tokenizer, bos: int | None = None) -> np.ndarray:
  """A text file's tokens: those of its whole text tokenized at once (as the perplexity guide
  does), read and encoded in bounded chunks, cut where the ids do not change (formats.text_tasks
  with the tokenizer, as the prepare step reads text): a whole file at once took ~300x its size.
  `bos`: an id put first."""
  ids = [np.asarray([] if bos is None else [bos], np.int64)]
  ids += [encode_text(tokenizer, task.text)
          for task, _ in formats.text_tasks(file, _FIELD, formats.TEXT_CHUNK_CHARS, tokenizer,
                                            exact=True)]
  return np.concatenate(ids).astype(np.int32)


def _record_tokens(file: Path, tokenizer, fmt) -> tuple[np.ndarray, np.ndarray | None,
                                                         np.ndarray]:
  """A JSONL(.zst/.gz), Parquet or Arrow file's documents as training stores them: (tokens,
  loss mask or None when every token is learned, where each document ends: [documents] int64
  offsets just past it). Bad records are errors naming file and line/row, or skipped with
  data.skip_bad_records."""
  tokens, masks, ends, skipped, at = [], [], [], 0, 0
  for task, _ in formats.record_tasks(file, fmt, _FIELD):
    result = formats.run_task(task, tokenizer, fmt, np.dtype(np.int32))
    if result.bad and not fmt.skip_bad_records:
      raise formats.bad_records_error(result.bad, result.skipped, _FIELD)
    skipped += result.skipped
    ends.append(result.ends + at)
    at += result.tokens.size
    tokens.append(result.tokens)
    masks.append(result.mask)
  if skipped:
    print(f'{_FIELD}: {file}: skipped {skipped} bad records (data.skip_bad_records=True)',
          flush=True)
  if not tokens:
    return np.zeros(0, np.int32), None, np.zeros(0, np.int64)
  mask = None
  if any(m is not None for m in masks):
    mask = np.concatenate([np.ones(t.size, np.uint8) if m is None else m
                           for t, m in zip(tokens, masks)])
  return np.concatenate(tokens), mask, np.concatenate(ends)


class EvalData(NamedTuple):
  """eval.path as one stream (`read_eval_data`)."""
  tokens: np.ndarray  # [N] int32
  mask: np.ndarray | None  # [N] uint8: token i is scored as a target where 1 (None: all are)
  starts: np.ndarray | None  # [N] uint8: 1 where a document begins (with a document mask)


def read_eval_data(path: str, tokenizer, data_config=None, document_eos: int = -1) -> EvalData:
  """The EvalData of eval.path: its files in order (module docstring) as one stream; mask[i] =
  1 when token i is scored as a target (None: all are).

  `data_config` (config.data) gives the record fields and EOS of record files (text_field,
  prompt_field, completion_field, eos_token, skip_bad_records); None: their defaults.
  `document_eos` (the model's document_eos_id; -1: none): model.document_mask is on; the
  documents of record files are kept apart where each record's ends (EvalData.starts, whatever
  ids they hold: a chat template may end every turn with the EOS), and the first token of each
  is not scored, as training does not learn it (data.unlearn_starts). In a text file, as in a
  text stream training reads, documents end at the EOS ids it holds.

  Raises:
    ConfigError: naming eval.path: it is empty or does not exist, a file is not UTF-8 text, a
      record is bad, or the stream has fewer than 2 tokens.
  """
  if not path:
    raise ConfigError('eval.path is empty: set it to the text to evaluate on (a text file, a '
                      '.jsonl, .jsonl.zst, .jsonl.gz, .parquet or .arrow file, a directory or a '
                      'glob pattern).')
  files = formats.expand_sources([path], _FIELD)
  formats.check_directories([path], False, _FIELD)
  fmt = None
  pieces = []
  for index, file in enumerate(files):
    if formats.source_format(file) == formats.TEXT:  # the stream's start: BOS, as tokenizer(text)
      text = _text_tokens(file, tokenizer, added_bos(tokenizer) if index == 0 else None)
      # Its documents end at the EOS ids it holds, if any.
      pieces.append((text, None, np.flatnonzero(text == document_eos).astype(np.int64) + 1))
      continue
    if fmt is None:
      fmt = (document_format(tokenizer) if data_config is None else
             data_format(data_config, tokenizer))
    pieces.append(_record_tokens(file, tokenizer, fmt))
  tokens = np.concatenate([t for t, _, _ in pieces])
  mask = starts = None
  if any(m is not None for _, m, _ in pieces):
    mask = np.concatenate([np.ones(t.size, np.uint8) if m is None else m for t, m, _ in pieces])
  if document_eos >= 0 and tokens.size:
    offsets = np.cumsum([0] + [t.size for t, _, _ in pieces[:-1]])
    ends = np.concatenate([e + at for (_, _, e), at in zip(pieces, offsets)])
    starts = np.zeros(tokens.size, np.uint8)
    starts[ends[ends < tokens.size]] = 1  # the next document begins where one ends
    # A document's first token is not scored as a target (token 0 never is one).
    mask = np.concatenate([np.ones(1, np.uint8),
                           unlearn_starts(starts, None if mask is None else mask[1:])])
  if tokens.size < 2:
    raise ConfigError(f'eval.path: {path} has {tokens.size} token(s); perplexity needs at least 2.')
  if mask is not None and not mask[1:].any():
    raise ConfigError(f'eval.path: {path} has no learned token to score (every record is all '
                      'prompt); evaluate on records with completions or assistant turns.')
  return EvalData(tokens, mask, starts)


def batch_windows(tokens: np.ndarray, chosen: list[Window], max_len: int, batch_size: int,
                  token_mask: np.ndarray | None = None, token_starts: np.ndarray | None = None):
  """([B, max_len + 1] int32 tokens, [B, max_len] float32 mask of the targets scored, and where
  documents begin [B, max_len + 1] uint8 or None) for up to `batch_size` windows; missing rows
  and the tail of a short window are padding, masked out. `token_mask` [N] (EvalData.mask):
  targets whose token has mask 0 are not scored either; `token_starts` [N] (EvalData.starts)."""
  batch = np.zeros((batch_size, max_len + 1), np.int32)
  mask = np.zeros((batch_size, max_len), np.float32)
  starts = None if token_starts is None else np.zeros(batch.shape, np.uint8)
  for row, w in enumerate(chosen):
    stop = min(w.begin + max_len + 1, tokens.size)
    batch[row, :stop - w.begin] = tokens[w.begin:stop]
    if starts is not None:
      starts[row, :stop - w.begin] = token_starts[w.begin:stop]
    scored = slice(w.first - w.begin - 1, w.end - w.begin - 1)
    mask[row, scored] = 1.0 if token_mask is None else token_mask[w.first:w.end]
  return batch, mask, starts


def _read_piece(reader, abstract_params, kind: str, start: int, stop: int) -> dict:
  """The params of piece [start, stop) of `kind` (partition.py) from a checkpoint reader."""
  template = jax.eval_shape(lambda p: partition.piece_of(p, kind, start, stop), abstract_params)

  def leaf(path, _):
    key = "['params']" + jax.tree_util.keystr(path)
    axis = partition.split_axis(key)
    return reader.read(key) if axis is None else reader.read(key, start, stop, axis=axis)

  return jax.tree_util.tree_map_with_path(leaf, template)


@functools.lru_cache(maxsize=4)
def _functions(cfg: model_lib.ModelConfig) -> '_Functions':
  """One _Functions per model shape: evaluators of one model share their traces."""
  return _Functions(cfg)


class _Functions:
  """The jitted stages of a forward pass (the model functions the engines use). Each stage that
  maps the hidden states [B, S, D] to new ones writes over them (donated), so a pass holds its
  windows' hidden states once rather than twice."""

  def __init__(self, cfg: model_lib.ModelConfig):
    self.embed = jax.jit(functools.partial(head_chunks.embed_chunk, cfg))
    self.embed_add = jax.jit(lambda rows, tokens, start, x: x + head_chunks.embed_chunk(
        cfg, rows, tokens, start), donate_argnums=3)
    self.group = jax.jit(lambda layers, x, positions: model_lib.apply_group(cfg, layers, x,
                                                                            positions),
                         donate_argnums=1)
    self.token_positions = jax.jit(functools.partial(model_lib.token_positions, cfg))
    self.final_norm = jax.jit(functools.partial(model_lib.final_norm, cfg), donate_argnums=1)
    self.lse_init = jax.jit(head_chunks.lse_init)
    self.lse_update = jax.jit(lambda weight, normed, targets, start, carry: head_chunks.lse_update(
        cfg, normed, weight, targets, start, carry))
    self.nll_sum = jax.jit(_nll_sum)


def _nll_sum(carry, mask):
  running_max, running_sum, target_logit = carry
  nll = running_max + jnp.log(running_sum) - target_logit
  return jnp.sum(nll * mask.reshape(-1))


def call_working_bytes(cfg: model_lib.ModelConfig, rows: int, max_len: int,
                       vocab_rows: int) -> int:
  """What one forward call over `rows` windows of `max_len` tokens computes in beyond its inputs
  and outputs: the larger of a layer's temporaries (schedule.layer_internal_bytes, what a backward
  keeps of the layer: an upper bound of the forward's) and a head chunk's [rows·S, Vc] float32
  logits with their exponentials and one more temporary (3·4·rows·S·Vc, as
  schedule.logits_bytes). Both grow linearly with `rows`."""
  return max(schedule.layer_internal_bytes(cfg, rows, max_len),
             3 * 4 * rows * max_len * vocab_rows)


class EvalMemory(NamedTuple):
  """How an evaluation runs its windows, and what it holds at once in device memory (bytes)."""
  rows: int  # windows per forward call: eval.batch_size, lowered to fit the working limit
  windows_per_pass: int  # windows whose hidden states are held while the weights stream by
  weights: int  # weight pieces held: the one computed and those read ahead (prefetch_depth)
  hidden: int  # the pass's hidden states [W, S, D] in the compute dtype and its loss carry
  working: int  # one call's temporaries (call_working_bytes)

  @property
  def total(self) -> int:
    return self.weights + self.hidden + self.working


class Evaluator:
  """Scores batches of windows, layer-major in passes, from `reader` (see the module docstring).

  Args:
    reader: `read(full-state path, start, stop, axis=)` of the model's params.
    cfg: The model.
    group_slices: Layer groups [(start, stop)] read at a time.
    vocab_slices: Vocabulary chunks [(start, stop)] of the embedding and the LM head.
    prefetch_depth: Pieces read ahead of the compute.
    working_bytes: The most one forward call may compute in (call_working_bytes): a batch of
      windows needing more runs a few windows at a time (`memory`), at least one.
  """

  def __init__(self, reader, cfg: model_lib.ModelConfig, group_slices, vocab_slices,
               prefetch_depth: int = 1, working_bytes: int = WORKING_BYTES):
    self.reader, self.cfg = reader, cfg
    self.groups, self.vocab = list(group_slices), list(vocab_slices)
    self.depth = max(1, prefetch_depth)
    self.working_bytes = working_bytes
    self.abstract = model_lib.abstract_params(cfg)
    self.fn = _functions(cfg)
    # The parameter count of each piece a pass reads, by kind, in order (embedding chunks, layer
    # groups, head chunks): its share of the pass, whose time goes to reading the weights and
    # multiplying by them (`nll_sums`' `advance`).
    head = 'embed' if cfg.tie_embeddings else 'head'
    self.kind_sizes = [[_piece_size(self.abstract, kind, *s) for s in slices] for kind, slices in (
        ('embed', self.vocab), ('layers', self.groups), (head, self.vocab))]
    self.piece_sizes = [size for sizes in self.kind_sizes for size in sizes]
    self._io = concurrent.futures.ThreadPoolExecutor(1, 'eval-read')  # one reader: in order

  def memory(self, max_len: int, batch_size: int, num_windows: int | None = None) -> EvalMemory:
    """How windows of `max_len` tokens, `batch_size` per call asked for, run (EvalMemory): as
    many per call as that, the windows there are (`num_windows`) and the working limit allow;
    as many per pass as PASS_BYTES of hidden states hold, in whole calls."""
    cfg, c = self.cfg, schedule.compute_bytes(self.cfg)
    vocab_rows = max(stop - start for start, stop in self.vocab)
    per_row = call_working_bytes(cfg, 1, max_len, vocab_rows)  # linear in the rows
    rows = max(1, min(batch_size, num_windows or batch_size, self.working_bytes // per_row))
    per_pass = rows * max(1, PASS_BYTES // (rows * max_len * cfg.d_model * c))
    if num_windows:
      per_pass = min(per_pass, -(-num_windows // rows) * rows)
    # Pieces in flight: the one computed and `depth` read ahead, of the heaviest kind, float32.
    weights = 4 * max(min(self.depth + 1, len(sizes)) * max(sizes) for sizes in self.kind_sizes)
    hidden = per_pass * max_len * (cfg.d_model * c + 3 * 4)  # + the running logsumexp [N] x 3
    return EvalMemory(rows, per_pass, weights, hidden, call_working_bytes(cfg, rows, max_len,
                                                                          vocab_rows))

  def close(self) -> None:
    self._io.shutdown(wait=True)

  def _fetch(self, kind: str):
    slices = self.groups if kind == 'layers' else self.vocab

    def fetch(key):
      return self._io.submit(
          lambda: jax.device_put(_read_piece(self.reader, self.abstract, kind, *slices[key])))
    return fetch

  def check_finite(self) -> None:
    """Raises TrainingDivergedError naming the tensors of the weights that hold NaN or inf
    (each piece read once more, on the host): called where a loss came out non-finite, so an
    evaluation of finite weights pays nothing, and NaN weights are named, not printed as a
    perplexity of nan."""
    head = 'embed' if self.cfg.tie_embeddings else 'head'
    pieces = [(kind, start, stop) for kind, slices in (
        ('embed', self.vocab), ('layers', self.groups), ('final_norm', [(0, 0)]),
        (head, self.vocab)) for start, stop in slices]
    found = []
    for kind, start, stop in dict.fromkeys(pieces):  # tied: the embedding chunks once
      where = '' if kind == 'final_norm' else f' ({kind} {start}:{stop})'
      piece = _read_piece(self.reader, self.abstract, kind, start, stop)
      for path, leaf in jax.tree_util.tree_leaves_with_path(piece):
        bad = leaf.size - int(np.count_nonzero(np.isfinite(leaf)))
        if bad:
          found.append(f"['params']{jax.tree_util.keystr(path)}{where}: {bad:,} of "
                       f'{leaf.size:,} values')
    if found:
      shown = '; '.join(found[:8]) + (f'; and {len(found) - 8} more' if len(found) > 8 else '')
      raise TrainingDivergedError(
          f'the weights evaluated hold NaN or infinite values, so their perplexity is nan: '
          f'{shown}. The run diverged before this checkpoint was saved, or its files are '
          'damaged: evaluate an earlier checkpoint (--config.checkpoint.read=STEP) or another '
          "run's.")

  def _pieces(self, kind: str, count: int) -> Prefetcher:
    return Prefetcher(self._fetch(kind), range(count), self.depth)

  def nll_sums(self, batches: list[tuple], advance=None) -> list[float]:
    """Σ of the masked-in tokens' negative log-likelihood, per ([B, S+1] tokens, [B, S] mask,
    [B, S+1] document starts or None) of `batch_windows`. `advance(share)`, if given, is called
    as each piece's work is done, with its share of the pass (the shares sum to 1)."""
    done = _PieceDone(advance, self.piece_sizes)
    inputs = [jnp.asarray(b[:, :-1]) for b, _, _ in batches]
    targets = [jnp.asarray(b[:, 1:]) for b, _, _ in batches]
    starts = [None if s is None else jnp.asarray(s[:, :-1]) for _, _, s in batches]
    # Positions with their RoPE tables, computed once for every group (model.RopePositions).
    positions = model_lib.positions_of_batches(self.cfg, inputs, self.fn.token_positions,
                                               starts)
    hidden = None
    for c, piece in self._pieces('embed', len(self.vocab)):
      start, rows = jnp.int32(self.vocab[c][0]), piece['embed']['embedding']
      hidden = ([self.fn.embed(rows, t, start) for t in inputs] if hidden is None else
                [self.fn.embed_add(rows, t, start, h) for t, h in zip(inputs, hidden)])
      done(hidden)  # before the next chunk's embed_add donates it
    for _, group in self._pieces('layers', len(self.groups)):
      hidden = [self.fn.group(group['layers'], h, p) for h, p in zip(hidden, positions)]
      done(hidden)
    norm = jax.device_put(_read_piece(self.reader, self.abstract, 'final_norm', 0, 0))
    normed = [self.fn.final_norm(norm, h) for h in hidden]
    del hidden
    carry = [self.fn.lse_init(t) for t in targets]
    head = 'embed' if self.cfg.tie_embeddings else 'head'
    for c, piece in self._pieces(head, len(self.vocab)):
      start = jnp.int32(self.vocab[c][0])
      weight = (piece['embed']['embedding'] if self.cfg.tie_embeddings else
                piece['head']['lm_head']['kernel'])
      carry = [self.fn.lse_update(weight, n, t, start, k)
               for n, t, k in zip(normed, targets, carry)]
      done(carry)
    return [float(self.fn.nll_sum(k, jnp.asarray(m))) for k, (_, m, _) in zip(carry, batches)]


def memory_line(memory: EvalMemory, max_len: int, batch_size: int, budget_bytes: float,
                host_peak_bytes: float) -> str:
  """The line --eval prints of how its windows run, what it holds in device memory
  (`Evaluator.memory`) and the process's predicted host peak.

  Raises:
    ConfigError: what it holds at once, with `memory.rows` windows per call, exceeds
      `budget_bytes` of device memory; naming the settings that shrink it (a lower
      eval.working_gb runs fewer windows per call).
  """
  gb = lambda n: f'{n / 1e9:.2f} GB'
  if memory.total > budget_bytes:
    raise ConfigError(
        f'--eval: windows of eval.max_len={max_len} tokens need {gb(memory.total)} of device '
        f'memory with {memory.rows} window(s) per call (weights {gb(memory.weights)}, hidden '
        f'states {gb(memory.hidden)}, one call\'s working set {gb(memory.working)}), and '
        f'{gb(budget_bytes)} is usable. Lower eval.max_len, or eval.working_gb, or '
        'model.attention_chunk (attention scores grow with it).')
  lowered = (f' (eval.batch_size={batch_size} lowered to fit eval.working_gb)'
             if memory.rows < batch_size else '')
  return (f'eval: windows of {max_len} tokens, {memory.rows} per call{lowered}, '
          f'{memory.windows_per_pass // memory.rows} call(s) per pass; device memory '
          f'{gb(memory.total)} of '
          f'{gb(budget_bytes)} (weights {gb(memory.weights)}, hidden states '
          f'{gb(memory.hidden)}, working set {gb(memory.working)}); predicted_host_peak_gb: '
          f'{host_peak_bytes / 1e9:.3f}')


def _piece_size(abstract_params, kind: str, start: int, stop: int) -> int:
  """The parameter count of piece [start, stop) of `kind` (partition.py)."""
  piece = jax.eval_shape(lambda p: partition.piece_of(p, kind, start, stop), abstract_params)
  return sum(leaf.size for leaf in jax.tree.leaves(piece))


class _PieceDone:
  """Calls `advance(size / Σ sizes)` as each piece of a pass is computed, in order of `sizes`;
  nothing (no wait) without `advance`. Waiting for a piece's outputs only after its last batch
  is dispatched leaves the device idle for just the next piece's first dispatch, and without it
  the bar would follow the dispatch, which runs ahead of the device."""

  def __init__(self, advance, sizes: list[int]):
    self.advance, self.total, self.sizes = advance, sum(sizes), iter(sizes)

  def __call__(self, outputs) -> None:
    if self.advance is not None:
      jax.block_until_ready(outputs)
      self.advance(next(self.sizes) / self.total)


def _bar_advance(bar, first: int, count: int):
  """`nll_sums`' advance(share) for the pass of windows [first, first + count): moves `bar` to
  the windows' worth of the shares done so far, in whole windows (floored: never ahead)."""
  done = float(first)

  def advance(share: float) -> None:
    nonlocal done
    done += share * count
    bar.update(min(int(done), first + count) - bar.n)
  return advance


def perplexity(evaluator: Evaluator, tokens: np.ndarray, max_len: int, stride: int,
               batch_size: int, progress: bool = True, mask: np.ndarray | None = None,
               starts: np.ndarray | None = None) -> dict:
  """eval/loss, eval/perplexity, eval/tokens (and the windows, timing) of `tokens`; with `mask`
  [N] (EvalData.mask) only the targets it marks are scored (eval/tokens counts them); with
  `starts` [N] (EvalData.starts) each document is kept to itself."""
  chosen = windows(int(tokens.size), max_len, stride)
  # Windows per call: batch_size, lowered to fit the evaluator's working limit and to the windows
  # there are (a short evaluation does not pay for padding rows).
  plan = evaluator.memory(max_len, batch_size, len(chosen))
  rows, per_pass = plan.rows, plan.windows_per_pass
  started, total, count = time.perf_counter(), 0.0, 0
  bar = metrics.progress_bar(len(chosen), progress, unit='window', desc='eval')
  with bar:
    for first in range(0, len(chosen), per_pass):
      part = chosen[first:first + per_pass]
      groups = [part[i:i + rows] for i in range(0, len(part), rows)]
      batches = [batch_windows(tokens, g, max_len, rows, mask, starts) for g in groups]
      # A pass may hold every window (83 at 1B, max_len 128): the bar moves within it, piece by
      # piece, rather than sitting at 0% until the pass ends.
      advance = None if bar.disable else _bar_advance(bar, first, len(part))
      total += sum(evaluator.nll_sums(batches, advance))
      if not math.isfinite(total):
        evaluator.check_finite()  # NaN weights named, not a perplexity of nan
      count += int(sum(m.sum() for _, m, _ in batches))
      bar.update(first + len(part) - bar.n)
  seconds = time.perf_counter() - started
  loss = total / count
  return {'eval/loss': loss, 'eval/perplexity': math.exp(min(loss, 80.0)), 'eval/tokens': count,
          'eval/windows': len(chosen), 'eval/max_len': max_len, 'eval/stride': stride,
          'eval/seconds': seconds, 'eval/seconds_per_1k_tokens': 1000.0 * seconds / count}
