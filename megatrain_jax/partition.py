"""Cutting the full train state into the pieces a streamed engine stores, and joining them back.

The full state (what the resident engine trains and every checkpoint holds) has layer leaves
stacked over all L layers. The streamed engine keeps one piece per stage (schedule.py), each
{'params': <subtree at its full-state paths>, 'opt_state': tx.init(those params)}:
  'embed':       params {'embed': ...}
  'final_norm':  params {'head': {'final_norm': ...}}
  'head':        params {'head': {'lm_head': ...}}          (absent when tied to the embedding)
  group g:       params {'layers': leaves[start:stop]}

Optax states mirror the params tree inside their own structure (e.g. AdamW's mu and nu), so a
leaf of a piece's optimizer state sits at the *same tree path* as the matching leaf of the full
state: pieces are filled by path, slicing leaves whose path goes through 'layers' and copying the
rest (step counts). This works for any optax transformation whose state is per-parameter or
scalar, which is what "elementwise" means here.
"""

import jax
import numpy as np
import optax

LAYERS = "['layers']"  # full-state paths through the layer stack contain this


def by_path(tree, prefix: str = '') -> dict:
  """{prefix + tree path: leaf}; prefix "['params']" turns a piece's paths into full-state paths."""
  return {prefix + jax.tree_util.keystr(p): x
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def outer_pieces(params) -> dict:
  """{piece name: its params subtree}, paths as in the full params tree (see module docstring)."""
  pieces = {'embed': {'embed': params['embed']},
            'final_norm': {'head': {'final_norm': params['head']['final_norm']}}}
  if 'lm_head' in params['head']:
    pieces['head'] = {'head': {'lm_head': params['head']['lm_head']}}
  return pieces


def join_pieces(pieces) -> dict:
  """The union of piece trees (each a nested dict at full-state paths): the inverse of
  `outer_pieces`."""
  joined = {}
  for tree in pieces:
    for key, value in tree.items():
      joined[key] = join_pieces([joined[key], value]) if key in joined else value
  return joined


def group_of(params, start: int, stop: int) -> dict:
  return {'layers': jax.tree.map(lambda a: a[start:stop], params['layers'])}


def _fill(template, source: dict, layer_leaf):
  """A tree shaped like `template` whose leaves come from `source` (by path)."""
  def leaf(path, _):
    key = jax.tree_util.keystr(path)
    return layer_leaf(key) if LAYERS in key else np.asarray(source[key])
  return jax.tree_util.tree_map_with_path(leaf, template)


def split_state(state: dict, tx: optax.GradientTransformation, slices) -> tuple[dict, list[dict]]:
  """Full state -> ({piece: outer piece}, [group pieces]) as host numpy arrays."""
  params = jax.tree.map(np.asarray, state['params'])
  full_opt = by_path(state['opt_state'])
  outer = {name: {'params': piece, 'opt_state': _fill(jax.eval_shape(tx.init, piece), full_opt, None)}
           for name, piece in outer_pieces(params).items()}
  groups = []
  for start, stop in slices:
    group_params = group_of(params, start, stop)
    opt = _fill(jax.eval_shape(tx.init, group_params), full_opt,
                lambda key, a=start, b=stop: np.asarray(full_opt[key])[a:b])
    groups.append({'params': group_params, 'opt_state': opt})
  return outer, groups


def merge_state(outer: dict, groups: list[dict], tx: optax.GradientTransformation, step, rng) -> dict:
  """({piece: outer piece}, [group pieces]) -> full state, as host numpy arrays."""
  layers = jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]),
                        *[g['params']['layers'] for g in groups])
  params = {**jax.tree.map(np.asarray, join_pieces(p['params'] for p in outer.values())),
            'layers': layers}
  outer_opt = {}  # the pieces' moments at their own paths; step counts, equal in every piece
  for piece in outer.values():
    outer_opt.update(by_path(piece['opt_state']))
  group_opts = [by_path(g['opt_state']) for g in groups]
  opt = _fill(jax.eval_shape(tx.init, params), outer_opt,
              lambda key: np.concatenate([np.asarray(g[key]) for g in group_opts]))
  return {'step': np.asarray(step), 'params': params, 'opt_state': opt, 'rng': np.asarray(rng)}


def _read_tree(template, prefix: str, read, start=None, stop=None):
  """A tree shaped like `template` read leaf by leaf from `read(full-state path[, start, stop])`:
  layers [start:stop] of stacked leaves, the whole leaf otherwise (step counts)."""
  def leaf(path, _):
    key = prefix + jax.tree_util.keystr(path)
    return read(key, start, stop) if LAYERS in key else read(key)
  return jax.tree_util.tree_map_with_path(leaf, template)


def group_template(tx: optax.GradientTransformation, abstract_params, start: int, stop: int):
  """ShapeDtypeStructs of group [start, stop)'s piece: {'params', 'opt_state'}."""
  params = jax.eval_shape(lambda p: group_of(p, start, stop), abstract_params)
  return {'params': params, 'opt_state': jax.eval_shape(tx.init, params)}


def read_outer(read, tx: optax.GradientTransformation, abstract_params) -> dict:
  """{piece: outer piece} from a checkpoint's `read` (see checkpoint.CheckpointReader.read)."""
  return {name: {'params': _read_tree(piece, "['params']", read),
                 'opt_state': _read_tree(jax.eval_shape(tx.init, piece), "['opt_state']", read)}
          for name, piece in outer_pieces(abstract_params).items()}


def read_group(read, tx: optax.GradientTransformation, abstract_params, start: int, stop: int,
               part: str) -> dict:
  """`part` ('params' or 'opt_state') of group [start, stop)'s piece from a checkpoint's `read`."""
  return _read_tree(group_template(tx, abstract_params, start, stop)[part], f"['{part}']", read,
                    start, stop)
