"""`Placement`: where each part of the train state lives, validated from `config.offload`.

Tiers: 'device' (accelerator memory) and 'host' (pinned host RAM, JAX memory kind
`pinned_host`). If every part is on the device the resident engine runs; otherwise the streamed
engine (engine/streamed.py) runs the model group by group.
"""

import dataclasses

import jax

from megatrain_jax.errors import ConfigError
from megatrain_jax.model import ModelConfig

TIERS = ('device', 'host')
OPTIMIZER_PLACES = ('device', 'host')
HOST_MEMORY_KIND = 'pinned_host'


@dataclasses.dataclass(frozen=True)
class Placement:
  params: str = 'device'
  opt_state: str = 'device'
  activations: str = 'device'
  embed_head: str = 'device'
  layers_per_group: int = 1
  prefetch_depth: int = 1
  optimizer_on: str = 'device'

  @property
  def streamed(self) -> bool:
    """True unless everything stays in device memory (then the resident engine is used)."""
    return any(t != 'device' for t in (self.params, self.opt_state, self.activations,
                                       self.embed_head))

  def group_slices(self, num_layers: int) -> list[tuple[int, int]]:
    """[(start, stop)] of each group; the last group holds the remainder."""
    k = self.layers_per_group
    return [(s, min(s + k, num_layers)) for s in range(0, num_layers, k)]

  @classmethod
  def from_config(cls, offload, model_cfg: ModelConfig) -> 'Placement':
    placement = cls(**{f.name: offload[f.name] for f in dataclasses.fields(cls)})
    placement.check(model_cfg)
    return placement

  def check(self, model_cfg: ModelConfig) -> None:
    for name in ('params', 'opt_state', 'activations', 'embed_head'):
      tier = getattr(self, name)
      if tier not in TIERS:
        hint = (' The NVMe tier is not implemented yet; use host.' if tier == 'nvme' else '')
        raise ConfigError(f'offload.{name}={tier!r} is not a tier: use one of '
                          f'{", ".join(TIERS)}.{hint}')
    if self.optimizer_on not in OPTIMIZER_PLACES:
      raise ConfigError(f'offload.optimizer_on={self.optimizer_on!r}: use device or host.')
    if self.optimizer_on == 'host' and (self.opt_state != 'host' or self.params != 'host'):
      raise ConfigError(
          "offload.optimizer_on='host' runs AdamW where the weights and Adam state live, so it "
          f'needs offload.params=host and offload.opt_state=host (got params={self.params}, '
          f"opt_state={self.opt_state}). Set those to host, or offload.optimizer_on='device'.")
    if not 1 <= self.layers_per_group <= model_cfg.num_layers:
      raise ConfigError(f'offload.layers_per_group={self.layers_per_group} must be between 1 and '
                        f'model.num_layers={model_cfg.num_layers}.')
    if self.prefetch_depth < 1:
      raise ConfigError(f'offload.prefetch_depth={self.prefetch_depth} must be >= 1: the number '
                        'of groups whose weights are fetched ahead of the compute.')
    if 'host' in (self.params, self.opt_state, self.activations, self.embed_head):
      device = jax.devices()[0]
      kinds = [m.kind for m in device.addressable_memories()]
      if HOST_MEMORY_KIND not in kinds:
        field = next(n for n in ('params', 'opt_state', 'activations', 'embed_head')
                     if getattr(self, n) == 'host')
        raise ConfigError(f'offload.{field}=host needs the memory kind {HOST_MEMORY_KIND!r}, which '
                          f'{device.device_kind} ({device.platform}) does not offer (it has '
                          f'{", ".join(kinds)}). Use offload.{field}=device on this backend.')
