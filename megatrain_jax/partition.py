"""Cutting the full train state into the pieces a streamed engine stores, and joining them back.

The full state (what the resident engine trains and every checkpoint holds) has layer leaves
stacked over all L layers. The streamed engine keeps pieces of four kinds (schedule.py), each piece
{'params': <subtree at its full-state paths>, 'opt_state': tx.init(those params)}:

  kind          key          params of the piece                          split along
  'layers'      group g      {'layers': leaves[start:stop]}               axis 0 (layers)
  'embed'       chunk c      {'embed': {'embedding': [start:stop, :]}}    axis 0 (vocabulary)
  'head'        chunk c      {'head': {'lm_head': {'kernel': [:, start:stop]}}}   axis 1
                             (absent when the head is tied to the embedding)
  'final_norm'  0            {'head': {'final_norm': ...}}                whole

Optax states mirror the params tree inside their own structure (e.g. AdamW's mu and nu), so a
leaf of a piece's optimizer state sits at the *same tree path* as the matching leaf of the full
state: pieces are filled by path, slicing the leaves `split_axis` names and copying the rest (step
counts). This works for any optax transformation whose state is per-parameter or scalar, which is
what "elementwise" means here.
"""

import functools

import jax
import numpy as np
import optax

LAYERS = "['layers']"  # full-state paths through the layer stack contain this
EMBEDDING = "['embed']['embedding']"  # [V, D]
HEAD_KERNEL = "['lm_head']['kernel']"  # [D, V]
KINDS = ('layers', 'embed', 'head', 'final_norm')


def by_path(tree, prefix: str = '') -> dict:
  """{prefix + tree path: leaf}; prefix "['params']" turns a piece's paths into full-state paths."""
  return {prefix + jax.tree_util.keystr(p): x
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def split_axis(path: str) -> int | None:
  """The axis along which the leaf at `path` (full-state or piece path) is cut into pieces:
  0 for layer leaves and the embedding, 1 for the head kernel, None for whole leaves."""
  if LAYERS in path or EMBEDDING in path:
    return 0
  return 1 if HEAD_KERNEL in path else None


def vocab_slices(vocab_size: int, d_model: int, shard_mb: float) -> list[tuple[int, int]]:
  """Vocabulary chunks [(start, stop)] of at most `shard_mb` MiB of float32 rows (at least one row
  per chunk); all but the last have the same length."""
  return list(_vocab_slices(vocab_size, d_model, shard_mb))


@functools.lru_cache(maxsize=256)
def _vocab_slices(vocab_size: int, d_model: int, shard_mb: float) -> tuple:
  # Cached: a planner search asks for the same few splits tens of thousands of times.
  rows = max(1, min(vocab_size, int(shard_mb * 2**20 // (4 * d_model))))
  return tuple((s, min(s + rows, vocab_size)) for s in range(0, vocab_size, rows))


def kinds_of(params) -> tuple[str, ...]:
  """The kinds a params tree has: no 'head' when it is tied to the embedding."""
  return KINDS if 'lm_head' in params['head'] else tuple(k for k in KINDS if k != 'head')


def piece_of(params, kind: str, start: int = 0, stop: int = 0) -> dict:
  """The params of piece [start, stop) of `kind` (see the module docstring)."""
  cut = lambda a, axis: a[(slice(None),) * axis + (slice(start, stop),)]
  if kind == 'layers':
    return {'layers': jax.tree.map(lambda a: cut(a, 0), params['layers'])}
  if kind == 'embed':
    return {'embed': {'embedding': cut(params['embed']['embedding'], 0)}}
  if kind == 'head':
    return {'head': {'lm_head': {'kernel': cut(params['head']['lm_head']['kernel'], 1)}}}
  return {'head': {'final_norm': params['head']['final_norm']}}


def join_pieces(pieces) -> dict:
  """The union of piece trees (nested dicts at full-state paths) that share no leaf."""
  joined = {}
  for tree in pieces:
    for key, value in tree.items():
      joined[key] = join_pieces([joined[key], value]) if key in joined else value
  return joined


def _fill(template, source: dict, start: int, stop: int):
  """A tree shaped like `template` whose leaves come from `source` (full-state path -> array):
  split leaves cut to [start, stop) along their axis, whole leaves (step counts) as they are."""
  def leaf(path, _):
    key = jax.tree_util.keystr(path)
    axis = split_axis(key)
    value = np.asarray(source[key])
    return value if axis is None else value[(slice(None),) * axis + (slice(start, stop),)]
  return jax.tree_util.tree_map_with_path(leaf, template)


def split_state(state: dict, tx: optax.GradientTransformation,
                slices: dict) -> dict[str, list[dict]]:
  """Full state -> {kind: [pieces in key order]} as host numpy arrays; `slices`: {kind: [(start,
  stop)]} for 'layers', 'embed' and 'head' (schedule.StepSchedule / the engine choose them)."""
  params = jax.tree.map(np.asarray, state['params'])
  full_opt = by_path(state['opt_state'])
  pieces = {}
  for kind in kinds_of(params):
    pieces[kind] = []
    for start, stop in slices.get(kind, [(0, 0)]):
      piece = piece_of(params, kind, start, stop)
      opt = _fill(jax.eval_shape(tx.init, piece), full_opt, start, stop)
      pieces[kind].append({'params': piece, 'opt_state': opt})
  return pieces


def merge_state(pieces: dict, tx: optax.GradientTransformation, step, rng) -> dict:
  """{kind: [pieces in key order]} -> full state, as host numpy arrays."""
  joined = {}  # full-state path -> [that leaf's part in every piece, in key order]
  for part in ('params', 'opt_state'):
    for kind_pieces in pieces.values():
      for piece in kind_pieces:
        for path, x in by_path(piece[part], f"['{part}']").items():
          joined.setdefault(path, []).append(np.asarray(x))

  def leaf(prefix):
    def join(path, _):
      key = prefix + jax.tree_util.keystr(path)
      axis = split_axis(key)  # step counts: equal in every piece
      return joined[key][0] if axis is None else np.concatenate(joined[key], axis=axis)
    return join
  structure = join_pieces(kind_pieces[0]['params'] for kind_pieces in pieces.values())
  params = jax.tree_util.tree_map_with_path(leaf("['params']"), structure)
  opt = jax.tree_util.tree_map_with_path(leaf("['opt_state']"), jax.eval_shape(tx.init, params))
  return {'step': np.asarray(step), 'params': params, 'opt_state': opt, 'rng': np.asarray(rng)}


def piece_template(tx: optax.GradientTransformation, abstract_params, kind: str, start: int,
                   stop: int) -> dict:
  """ShapeDtypeStructs of piece [start, stop) of `kind`: {'params', 'opt_state'}."""
  params = jax.eval_shape(lambda p: piece_of(p, kind, start, stop), abstract_params)
  return {'params': params, 'opt_state': jax.eval_shape(tx.init, params)}


def read_piece(read, tx: optax.GradientTransformation, abstract_params, kind: str, start: int,
               stop: int, part: str, known_zero=None, read_box=None) -> dict:
  """`part` ('params' or 'opt_state') of piece [start, stop) of `kind`, leaf by leaf from a
  checkpoint's `read(full-state path[, start, stop])` (rows [start:stop] of a leaf's axis 0).
  `known_zero(full-state path)`: split leaves it names are not read but given as their
  jax.ShapeDtypeStruct (zeros, for a store that makes them: tiers/nvme.py). With `read_box`
  (the checkpoint's `read_box(full-state path, box)`) split leaves are not read here but given as
  LazySlices: with several processes each one reads only the boxes of its own shards."""
  template = piece_template(tx, abstract_params, kind, start, stop)[part]
  def leaf(path, abstract):
    key = f"['{part}']" + jax.tree_util.keystr(path)
    axis = split_axis(key)
    if axis is None:
      return read(key)
    if known_zero is not None and known_zero(key):
      return abstract
    if read_box is not None:
      return LazySlice(lambda box, key=key: read_box(key, _shifted(box, axis, start)),
                       abstract.shape, abstract.dtype)
    return read(key, start, stop) if axis == 0 else read(key, start, stop, axis=axis)
  return jax.tree_util.tree_map_with_path(leaf, template)


def _shifted(box: tuple, axis: int, start: int) -> tuple:
  """A box ((start, stop) per axis) of a piece as the box of the full-state leaf it was cut from
  at `start` along `axis`."""
  return tuple((a + start, b + start) if d == axis else (a, b) for d, (a, b) in enumerate(box))


class LazySlice:
  """A host leaf not read yet: a piece of a checkpoint leaf that is read box by box, only where
  asked (`read_box(((start, stop), ...))` -> that box as a host array). With several processes
  the stores are handed these, so that each process reads only its own devices' shards of a
  piece (layout.place, layout.host_part) instead of all of it: P processes reading a checkpoint
  read it once between them, not P times."""

  def __init__(self, read_box, shape: tuple, dtype):
    self.read_box, self.shape, self.dtype = read_box, tuple(shape), np.dtype(dtype)

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape)) * self.dtype.itemsize

  def whole(self) -> np.ndarray:
    return self.read_box(tuple((0, n) for n in self.shape))
