"""`Placement`: where each part of the train state lives, validated from `config.offload`.

Tiers: 'device' (accelerator memory), 'host' (pinned host RAM, JAX memory kind `pinned_host`)
and, for layer weights and Adam state, 'nvme' (TensorStore arrays on local disk, tiers/nvme.py).
If every part is on the device the resident engine runs; otherwise the streamed engine
(engine/streamed.py) runs the model group by group.
"""

import dataclasses
import math

from megatrain_jax import layout
from megatrain_jax import partition
from megatrain_jax.errors import ConfigError
from megatrain_jax.model import ModelConfig
from megatrain_jax.tiers import codecs

TIERS = ('device', 'host', 'nvme')
MEMORY_TIERS = ('device', 'host')  # activations never go to disk
OPTIMIZER_PLACES = ('device', 'host')
PARK_PLACES = ('weights', 'device')  # where a deferred update's layer gradients wait (park_grads)
HOST_MEMORY_KIND = 'pinned_host'
AUTO = 'auto'  # a field the planner (planner.py) chooses
_GB = 1e9
# Weights per band of a deferred host-optimizer update (engine/updates.py), and the largest
# vocabulary chunk. 64 MiB keeps one jitted AdamW call long (tens of ms at host memory bandwidth)
# against its dispatch (~0.1 ms), while the update's host memory stays (prefetch_depth + 1) bands
# of p, g, m, v plus the write-behind, whatever the layer size (a larger single leaf is a band).
UPDATE_BAND_MB = 64


@dataclasses.dataclass(frozen=True)
class Placement:
  params: str = 'device'
  opt_state: str = 'device'
  activations: str = 'device'
  embed_head: str = 'device'
  layers_per_group: int = 1
  prefetch_depth: int = 1
  optimizer_on: str = 'device'
  dir: str = ''  # NVMe tier directory; '' = <workdir>/offload (resolved by the trainer)
  codec: str = 'none'
  codec_level: int = 1
  shard_mb: float = 512.0
  host_buffer_gb: float = 8.0
  device_memory_gb: float = 0.0  # planner budgets; 0 = the hardware profile's
  host_memory_gb: float = 0.0
  # K > 1: keep each group's K per-layer inputs [K, B, S, D] from the forward (True), so the
  # backward recomputes each layer once, or only the group's input [B, S, D] (False), so it
  # recomputes the group to get them back (a third forward per layer with model.remat).
  # 'auto': the planner keeps them when that fits and is faster (planner._option_variants).
  keep_layer_inputs: bool | str = False
  # With exact clipping every group's gradient waits for the global norm before its update: in the
  # weights' tier ('weights': device memory stays bounded by a few groups) or, for an update on the
  # device, in device memory ('device': 4·L·P_l more of it, and no round trip of each gradient
  # through the host: 7 group-sized transfers per group and step instead of 9). 'auto': the
  # planner parks them on the device when that fits and is faster (planner._option_variants).
  park_grads: str = 'weights'

  @property
  def streamed(self) -> bool:
    """True unless everything stays in device memory (then the resident engine is used)."""
    return any(t != 'device' for t in (self.params, self.opt_state, self.activations,
                                       self.embed_head))

  def group_slices(self, num_layers: int) -> list[tuple[int, int]]:
    """[(start, stop)] of each group; the last group holds the remainder."""
    k = self.layers_per_group
    return [(s, min(s + k, num_layers)) for s in range(0, num_layers, k)]

  def group_bytes(self, model_cfg: ModelConfig, tier: str) -> int:
    """Bytes of the largest group's leaves held in `tier`: 4 B/param weights, 8 B/param Adam."""
    per_param = 4 * (self.params == tier) + 8 * (self.opt_state == tier)
    return per_param * self.layers_per_group * model_cfg.params_per_layer

  def vocab_slices(self, model_cfg: ModelConfig) -> list[tuple[int, int]]:
    """The embedding / head vocabulary chunks: at most `shard_mb` each, no heavier than one layer
    group's weights (a chunk in flight costs no more than a group does) and no heavier than one
    update band (a chunk is one leaf: its update cannot be cut smaller). Llama-3.2-1B: 16 chunks
    of 8,192 rows (64 MiB)."""
    group_mb = self.layers_per_group * model_cfg.params_per_layer * 4 / 2**20
    return partition.vocab_slices(model_cfg.vocab_size, model_cfg.d_model,
                                  min(self.shard_mb, UPDATE_BAND_MB, max(group_mb, 1.0)))

  def update_band_bytes(self) -> int:
    """Weights per band of a host-optimizer update (engine/updates.py)."""
    return int(min(self.shard_mb, UPDATE_BAND_MB) * 2**20)

  def staged_reads_bytes(self, model_cfg: ModelConfig) -> int:
    """NVMe reads on their way to the device at once, each a `device_put` of numpy that XLA's GPU
    client copies into its pinned pool first (planner.pinned_pool_rows): prefetch_depth + 1
    groups of the disk-resident weights and, with the optimizer on the device, of their Adam
    state and parked gradients (the host optimizer reads those into pinned host memory: a row
    of its own). An embedding/head chunk on NVMe is no heavier than a group (vocab_slices) and
    read in another stage: it adds nothing to the peak."""
    on_device = self.optimizer_on == 'device'
    per_param = (4 * (self.params == 'nvme') + 8 * (self.opt_state == 'nvme' and on_device)
                 + 4 * (self.parked_grads_tier == 'nvme' and on_device))
    return ((self.prefetch_depth + 1) * per_param * self.layers_per_group *
            model_cfg.params_per_layer if self.streamed else 0)

  def staging_bytes(self, model_cfg: ModelConfig, groups_in_flight: int) -> int:
    """Host staging of the NVMe pipeline: `groups_in_flight` groups of the disk-resident leaves."""
    return groups_in_flight * self.group_bytes(model_cfg, 'nvme')

  def auto_host_buffer_gb(self, model_cfg: ModelConfig) -> float:
    """The staging an NVMe pipeline needs: prefetch_depth + 1 groups being read and one being
    written (the write-behind budget, shared by every NVMe store: write_budget_bytes)."""
    return self.staging_bytes(model_cfg, groups_in_flight=self.prefetch_depth + 2) / _GB

  def write_budget_bytes(self, model_cfg: ModelConfig) -> int:
    """Bytes of write-behind all NVMe stores may hold queued together: host_buffer_gb less the
    reads in flight (prefetch_depth + 1 groups), never below one group (a piece always fits)."""
    group = max(self.group_bytes(model_cfg, 'nvme'), 1)
    return int(max(group, self.host_buffer_gb * _GB - (self.prefetch_depth + 1) * group))

  def max_pending_writes(self, model_cfg: ModelConfig) -> int:
    """Writes one store may queue (each store also waits for the shared byte budget)."""
    group = max(self.group_bytes(model_cfg, 'nvme'), 1)
    return max(1, int(self.host_buffer_gb * _GB // group) - (self.prefetch_depth + 1))

  @classmethod
  def from_config(cls, offload, model_cfg: ModelConfig, allow_auto: bool = False) -> 'Placement':
    """The placement `offload` (config.offload) describes, checked; with `allow_auto` it may
    still hold 'auto' fields for the planner to resolve."""
    fields = {f.name: offload[f.name] for f in dataclasses.fields(cls)}
    # The config field is a string (ml_collections keeps a field's type): 'true' / 'false' are
    # the bools; anything else but 'auto' is refused by check().
    keep = fields['keep_layer_inputs']
    if isinstance(keep, str) and keep.lower() in ('true', 'false'):
      fields['keep_layer_inputs'] = keep.lower() == 'true'
    placement = cls(**fields)
    placement.check(model_cfg, allow_auto)
    return placement

  @property
  def keeps_layer_inputs(self) -> bool:
    """The forward saves every layer's input of a group, not just the group's (only K > 1 differs:
    a one-layer group's input is its layer's)."""
    return self.keep_layer_inputs is True and self.layers_per_group > 1

  @property
  def parked_grads_tier(self) -> str:
    """The tier where the layer groups' gradients wait for a deferred update."""
    return 'device' if self.park_grads == 'device' else self.params

  @property
  def uses_nvme(self) -> bool:
    """True when some state lives in the NVMe tier (layers, their Adam state, embedding/head)."""
    return 'nvme' in (self.params, self.opt_state, self.embed_head)

  @property
  def has_auto(self) -> bool:
    return (AUTO in (self.params, self.opt_state, self.activations, self.embed_head,
                     self.optimizer_on) or self.layers_per_group == 0 or self.prefetch_depth == 0
            or self.host_buffer_gb == 0 or AUTO in (self.keep_layer_inputs, self.park_grads))

  def describe(self, num_layers: int) -> str:
    """One line for the console: the engine and, when streamed, where each part lives."""
    if not self.streamed:
      return 'resident engine (all state in device memory)'
    groups = len(self.group_slices(num_layers))
    return (f'streamed engine: params on {self.params}, Adam state on {self.opt_state}, '
            f'activations on {self.activations}, embedding/head on {self.embed_head}, '
            f'{groups} group{"s" * (groups != 1)} of {self.layers_per_group} '
            f'layer{"s" * (self.layers_per_group != 1)}{self._kept_note()}, prefetch '
            f'depth {self.prefetch_depth}, optimizer on {self.optimizer_on}{self._park_note()}')

  def summary(self) -> str:
    """The same, compact, for the planner's tables and refusals."""
    if not self.streamed:
      return 'resident (all on device)'
    return (f'params {self.params}, Adam {self.opt_state}, activations {self.activations}, '
            f'embed/head {self.embed_head}, optimizer on {self.optimizer_on}, '
            f'K={self.layers_per_group}{self._kept_note()}, prefetch {self.prefetch_depth}'
            f'{self._park_note()}')

  def _park_note(self) -> str:
    """Where deferred updates' gradients wait, when that is not the weights' tier."""
    if self.park_grads == 'weights' or self.params == 'device':
      return ''
    return ', gradients parked: auto' if self.park_grads == AUTO else ', gradients parked on device'

  def _kept_note(self) -> str:
    """What a group of K > 1 saves for its backward (nothing to say when K = 1)."""
    if self.layers_per_group == 1 and self.keep_layer_inputs != AUTO:
      return ''
    if self.keep_layer_inputs == AUTO:
      return ' (layer inputs kept: auto)'
    return ' (layer inputs kept)' if self.keeps_layer_inputs else ' (group inputs only)'

  def check(self, model_cfg: ModelConfig, allow_auto: bool = False) -> None:
    """Checks every field; with `allow_auto`, 'auto' (tiers) and 0 (K, depth) pass, for the
    planner to resolve."""
    self._check_tiers(allow_auto)
    self._check_storage()
    self._check_pipeline(model_cfg, allow_auto)
    if self.has_auto:
      return  # the rest needs concrete values: checked again once the planner has chosen
    self._check_resolved(model_cfg)

  def _check_tiers(self, allow_auto: bool) -> None:
    """Each part of the state names a tier it may live in (or 'auto', when allowed)."""
    auto = (AUTO,) if allow_auto else ()
    for name, allowed in (('params', TIERS), ('opt_state', TIERS),
                          ('activations', MEMORY_TIERS), ('embed_head', TIERS)):
      tier = getattr(self, name)
      if tier not in allowed + auto:
        raise ConfigError(f'offload.{name}={tier!r} is not a tier for it: use one of '
                          f'{", ".join(allowed + auto)}.')
    if self.park_grads not in PARK_PLACES + auto:
      raise ConfigError(f'offload.park_grads={self.park_grads!r}: use weights (gradients wait for '
                        "a deferred update in the weights' tier), device (in device memory) or "
                        f'{"auto" if allow_auto else "auto (in a config, for the planner)"}.')

  def _check_storage(self) -> None:
    """The on-disk codec, its level and chunk size, and the planner's memory budgets."""
    if self.codec not in codecs.CODECS:
      raise ConfigError(f'offload.codec={self.codec!r}: use one of {", ".join(codecs.CODECS)}.')
    if self.codec in codecs.CODEC_LEVELS:
      low, high = codecs.CODEC_LEVELS[self.codec]
      if not low <= self.codec_level <= high:
        raise ConfigError(f'offload.codec_level={self.codec_level} is out of range for '
                          f'offload.codec={self.codec!r}: use a level in [{low}, {high}].')
    # `not x > 0` rather than `x <= 0`: NaN must be refused too.
    if not self.shard_mb > 0:
      raise ConfigError(f'offload.shard_mb={self.shard_mb} must be > 0 (MB per on-disk chunk).')
    for name in ('device_memory_gb', 'host_memory_gb'):
      value = getattr(self, name)
      if not 0 <= value < math.inf:  # NaN fails too
        raise ConfigError(f'offload.{name}={value} must be a number of GB >= 0 (the memory the '
                          "planner may fill; 0 = the hardware profile's).")

  def _check_pipeline(self, model_cfg: ModelConfig, allow_auto: bool) -> None:
    """The staging buffer, where AdamW runs, the group size K and the prefetch depth."""
    auto = (AUTO,) if allow_auto else ()
    if not (self.host_buffer_gb > 0 or (allow_auto and self.host_buffer_gb == 0)):
      raise ConfigError(f'offload.host_buffer_gb={self.host_buffer_gb} must be > 0 (GB of host '
                        'RAM for the NVMe staging buffers).')
    if self.optimizer_on not in OPTIMIZER_PLACES + auto:
      raise ConfigError(f'offload.optimizer_on={self.optimizer_on!r}: use device, host or auto.')
    if not (self.layers_per_group == 0 and allow_auto) and not (
        1 <= self.layers_per_group <= model_cfg.num_layers):
      raise ConfigError(f'offload.layers_per_group={self.layers_per_group} must be between 1 and '
                        f'model.num_layers={model_cfg.num_layers}, or 0 for auto.')
    if not (self.prefetch_depth == 0 and allow_auto) and self.prefetch_depth < 1:
      raise ConfigError(f'offload.prefetch_depth={self.prefetch_depth} must be >= 1 (the number '
                        'of groups whose weights are fetched ahead of the compute), or 0 for auto.')
    keep = self.keep_layer_inputs
    if not (isinstance(keep, bool) or (keep == AUTO and allow_auto)):
      # 'auto' here is a placement the engine would run as given: only the planner resolves it.
      raise ConfigError(f'offload.keep_layer_inputs={keep!r}: use true (keep every layer input '
                        'of a group for the backward), false (keep only the group input) or '
                        f'{"auto" if allow_auto else "auto (in a config, for the planner)"}.')

  def _check_resolved(self, model_cfg: ModelConfig) -> None:
    """Checks that need every field concrete: the NVMe staging fits host_buffer_gb, AdamW on the
    host has its state off the device, and the backend offers pinned host memory."""
    if self.uses_nvme:
      needed = self.staging_bytes(model_cfg, groups_in_flight=self.prefetch_depth + 2)
      if self.host_buffer_gb * _GB < needed:
        raise ConfigError(
            f'offload.host_buffer_gb={self.host_buffer_gb} is too small: the NVMe pipeline needs '
            f'{needed / _GB:.2f} GB of host staging for prefetch_depth + 1 groups being read and '
            'one being written. Raise offload.host_buffer_gb, or lower offload.layers_per_group '
            'or offload.prefetch_depth.')
    if self.optimizer_on == 'host' and 'device' in (self.opt_state, self.params):
      raise ConfigError(
          "offload.optimizer_on='host' runs AdamW in host memory, next to the weights and Adam "
          'state, so it needs offload.params and offload.opt_state off the device (host or nvme; '
          f"got params={self.params}, opt_state={self.opt_state}). Move them, or set "
          "offload.optimizer_on='device'.")
    if self.park_grads == 'device' and self.optimizer_on == 'host':
      raise ConfigError(
          "offload.park_grads='device' keeps gradients in device memory for an update on the "
          "device, but offload.optimizer_on='host' updates on the host, where every gradient goes "
          "anyway. Set offload.park_grads='weights' (or 'auto'), or offload.optimizer_on='device'.")
    if 'host' in (self.params, self.opt_state, self.activations, self.embed_head):
      device = layout.default_devices()[0]
      kinds = layout.available_memory_kinds()
      if HOST_MEMORY_KIND not in kinds:
        field = next(n for n in ('params', 'opt_state', 'activations', 'embed_head')
                     if getattr(self, n) == 'host')
        raise ConfigError(f'offload.{field}=host needs the memory kind {HOST_MEMORY_KIND!r}, which '
                          f'{device.device_kind} ({device.platform}) does not offer (it has '
                          f'{", ".join(kinds)}). Use offload.{field}=device on this backend.')
