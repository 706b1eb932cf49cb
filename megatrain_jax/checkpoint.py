"""Checkpoints: an orbax CheckpointManager over (train state, JSON metadata).

Layout: <workdir>/checkpoints/<step>/{state, meta}. Orbax commits each step atomically (it writes
to a temporary directory and renames it when complete), so a killed run leaves either a whole
checkpoint or one orbax ignores. Saves are asynchronous: the state is copied to host memory before
`save` returns, the files are written in the background while training continues.

`meta` holds what resume needs besides the arrays: the data sampler position, and the model
config, so that resuming with different shapes fails with a clear message instead of an orbax
shape error.
"""

import dataclasses
import pathlib

import jax
import orbax.checkpoint as ocp

from megatrain_jax import faults
from megatrain_jax.errors import ConfigError
from megatrain_jax.model import ModelConfig


def _with_sharding(abstract_tree, memory_kind: str):
  """Restore targets need a sharding: the default device, in device or pinned host memory."""
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=memory_kind)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                      abstract_tree)


class Checkpointer:
  """Saves and restores train states in `<workdir>/checkpoints`, keeping the `keep` newest."""

  def __init__(self, workdir: pathlib.Path, keep: int):
    self.directory = pathlib.Path(workdir).absolute() / 'checkpoints'
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=('state', 'meta'))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state, *, data_position: int, model_cfg: ModelConfig) -> None:
    meta = {'step': step, 'data_position': int(data_position),
            'model_config': dataclasses.asdict(model_cfg)}
    self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                     meta=ocp.args.JsonSave(meta)), force=True)
    faults.point('checkpoint')  # files being written in the background, nothing committed

  def restore(self, step: int, abstract_state, model_cfg: ModelConfig,
              memory_kind: str = 'device'):
    """Returns (state, meta) of checkpoint `step`; refuses one written for other model shapes."""
    meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']
    saved = meta['model_config']
    current = dataclasses.asdict(model_cfg)
    shape_fields = ('vocab_size', 'd_model', 'num_layers', 'num_heads', 'num_kv_heads', 'd_ff',
                    'head_dim', 'qkv_bias', 'tie_embeddings')
    changed = [f'model.{k}: checkpoint {saved[k]!r}, config {current[k]!r}'
               for k in shape_fields if saved.get(k) != current[k]]
    if changed:
      raise ConfigError(f'the checkpoint at {self.directory / str(step)} was written for other '
                        f'model shapes ({"; ".join(changed)}). Use the config it was trained with, '
                        'or a new --workdir to start fresh.')
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(_with_sharding(abstract_state, memory_kind))))
    return restored['state'], meta

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
