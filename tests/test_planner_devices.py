"""The planner on N devices (issue 13) and where its hardware profile came from (issue 14).

Per device, each piece of the state shrinks to 1/N in every tier while the activations are
those of the per-device batch B/N and the piece being computed is whole; one process driving all
N devices holds every shard in its host RAM and drives. Collective time appears for N > 1, grows
with the bytes and falls with the interconnect's bandwidth. A 2-device dry run works on this
1-device machine; the plan names its profile's origin (a calibration file by its path), and a
refusal names the hardware presets that would fit. Arithmetic only (no wall clock), except the
calibration probe's all-gather, which is checked for a number, not a speed.
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import pytest

from megatrain_jax import calibrate
from megatrain_jax import config as config_lib
from megatrain_jax import hardware
from megatrain_jax import layout
from megatrain_jax import planner
from megatrain_jax.errors import ConfigError
from megatrain_jax.placement import Placement

from helpers import REPO_ROOT

_GB = 1e9
CONFIG_7B = config_lib.load_config('7b', hardware='h100')
CFG_7B = planner.model_lib.ModelConfig.from_config_dict(CONFIG_7B.model)
SIZES_7B = planner.state_sizes(CFG_7B, planner.train_key(CONFIG_7B.train))
H100 = hardware.PRESETS['h100']
BIG = {'device': 1e15, 'host': 1e15, 'nvme': 1e15}
# Every state row of a streamed step in some tier: params and Adam on host, activations on host,
# the embedding/head on NVMe (the staging buffer is the process's), device optimizer.
STREAMED = Placement(params='host', opt_state='host', activations='host', embed_head='nvme',
                     optimizer_on='device', layers_per_group=2, prefetch_depth=1,
                     host_buffer_gb=1.0)
BATCH, SEQ, MICRO = 8, 512, 2


def _plan(devices, placement=STREAMED, hw=H100, batch=BATCH, micro=MICRO, clipping=True):
  return planner.make_plan(CFG_7B, SIZES_7B, placement, hw, micro=micro, batch=batch, seq=SEQ,
                           clipping=clipping, budgets=BIG, checkpoint_copies=1, devices=devices)


def _rows(plan, tier):
  return {r.item: r.bytes for r in plan.rows if r.tier == tier}


# The rows that depend on the batch (activations); every other row holds pieces of the state.
ACTIVATION_ROWS = {'hidden states + their gradients', 'group backward working set',
                   'head working set (one vocabulary chunk)'}
GATHERED_ROWS = {'gathered group + its gradient (N > 1)', 'gathered vocabulary chunk (N > 1)'}


@pytest.mark.parametrize('n', [2, 4, 8])
def test_device_rows_hold_one_nth_of_the_state_and_the_per_device_batch(n):
  one = _plan(planner.Devices())
  many = _plan(planner.Devices(n, n))
  per_device_batch = _plan(planner.Devices(), batch=BATCH // n)  # one device, B/N sequences
  device_one, device_many = _rows(one, 'device'), _rows(many, 'device')
  activations = _rows(per_device_batch, 'device')
  assert set(device_many) == set(device_one) | GATHERED_ROWS
  for item, nbytes in device_one.items():
    if item in ACTIVATION_ROWS:  # the activations of the device's own B/N sequences
      assert device_many[item] == activations[item], item
    else:  # weights in flight, gradient accumulator, update inputs, vocabulary chunks
      assert device_many[item] == pytest.approx(nbytes / n), item
  # The group being computed is whole: gathered weights and the gradient before its reduce-scatter.
  assert device_many['gathered group + its gradient (N > 1)'] == 2 * SIZES_7B.group_params(2)
  assert not GATHERED_ROWS & set(device_one)


def test_per_device_memory_falls_with_n():
  used = [_plan(planner.Devices(n, n)).used('device') for n in (1, 2, 4, 8)]
  state = [sum(b for item, b in _rows(_plan(planner.Devices(n, n)), 'device').items()
               if item not in ACTIVATION_ROWS | GATHERED_ROWS) for n in (1, 2, 4, 8)]
  assert state == pytest.approx([state[0] / n for n in (1, 2, 4, 8)])
  assert used[1] > used[2] > used[3]  # past 2 devices only shards shrink; the gathered group stays
  # Resident: params, Adam and gradients 1/N each, plus one gathered layer and its gradient.
  resident = [_plan(planner.Devices(n, n), placement=Placement(), micro=1) for n in (1, 4)]
  one, four = (_rows(p, 'device') for p in resident)
  for item in ('params', 'Adam m, v', 'gradients'):
    assert four[item] == pytest.approx(one[item] / 4)
  assert four['gathered layer + its gradient (N > 1)'] == 2 * SIZES_7B.layer_params


def test_host_and_nvme_rows_are_the_process_shares():
  """One process driving all N devices holds every device's host and NVMe shard (the same bytes
  as one device); one process per device holds 1/N of them."""
  one = _plan(planner.Devices())
  same_machine = _plan(planner.Devices(4, 4))
  own_machine = _plan(planner.Devices(4, 1))
  for tier in ('host', 'nvme'):
    for item, nbytes in _rows(one, tier).items():
      if item in (planner.STAGING_ROW, planner.RUNTIME_ROW, planner.PROGRAMS_ROW):  # own
        assert _rows(own_machine, tier)[item] == nbytes
        continue
      if item == planner.POOL_ROW:  # each process's pool grows from its own pinned rows
        for plan in (one, same_machine, own_machine):
          pinned = planner.pinned_bytes(plan.rows)
          cap = H100.host_memory_gb * 2**30
          assert _rows(plan, tier)[item] == pytest.approx(
              planner.pinned_pool_bytes(pinned + plan.staged_bytes, cap) - pinned)
        continue
      assert _rows(same_machine, tier)[item] == pytest.approx(nbytes), item
      assert _rows(own_machine, tier)[item] == pytest.approx(nbytes / 4), item
  assert own_machine.used('nvme') == pytest.approx(one.used('nvme') / 4)


def test_per_device_traffic_falls_n_fold():
  """Each device streams its shard: host<->device and disk bytes per device are 1/N, plus the
  activations of its own sequences (here stashed on the host: those of B/N)."""
  args = (CFG_7B, SIZES_7B, STREAMED, MICRO)
  one = planner.traffic(*args, BATCH, SEQ, True)
  no_activations = dict(planner.traffic(*args, BATCH, SEQ, True, 4))
  per_device_batch = planner.traffic(*args, BATCH // 4, SEQ, True)
  stash = 2 * planner.StepSchedule(STREAMED, CFG_7B, MICRO, True).num_groups * MICRO * (
      planner.hidden_bytes(CFG_7B, BATCH // 4, SEQ))  # boundary activations out and back
  total = lambda t: sum(t.values())
  assert total(no_activations) == pytest.approx((total(one) - 4 * stash) / 4 + stash)
  assert no_activations['read'] == pytest.approx(one['read'] / 4)
  assert no_activations['write'] == pytest.approx(one['write'] / 4)
  assert total(per_device_batch) - stash == pytest.approx(total(one) - 4 * stash)
  # The disk time is the process's: its drives serve all 4 devices' shards.
  same_machine, own_machine = _plan(planner.Devices(4, 4)), _plan(planner.Devices(4, 1))
  assert same_machine.times['disk'] == pytest.approx(4 * own_machine.times['disk'])
  assert own_machine.times['h2d'] == pytest.approx(same_machine.times['h2d'])  # a link each


def test_collective_time_appears_grows_with_bytes_and_falls_with_bandwidth():
  assert 'interconnect' not in _plan(planner.Devices()).times
  assert _plan(planner.Devices()).collectives == {}
  two = _plan(planner.Devices(2, 2))
  c = two.collectives
  W = SIZES_7B.group_params(CFG_7B.num_layers)
  E, H = SIZES_7B.embed_params, SIZES_7B.head_params
  assert c['all_gather'] == MICRO * (2 * W + E + 2 * H)  # groups fwd + bwd, embedding, head x2
  assert c['reduce_scatter'] == MICRO * (W + E + H)
  link = H100.interconnect_gbps * _GB
  assert two.times['interconnect'] == pytest.approx(1 / 2 * sum(c.values()) / link)
  # Each device receives (N - 1)/N of the same whole bytes.
  four = _plan(planner.Devices(4, 4))
  assert four.times['interconnect'] == pytest.approx(two.times['interconnect'] * (3 / 4) / (1 / 2))
  # Twice the microbatches: twice the gathers and reduce-scatters, twice the time.
  more = _plan(planner.Devices(2, 2), micro=2 * MICRO)
  assert more.times['interconnect'] == pytest.approx(2 * two.times['interconnect'])
  # Twice the bandwidth: half the time.
  fast = dataclasses.replace(H100, interconnect_gbps=2 * H100.interconnect_gbps)
  assert _plan(planner.Devices(2, 2), hw=fast).times['interconnect'] == pytest.approx(
      two.times['interconnect'] / 2)
  # No interconnect in the profile (a one-device calibration): the host link is assumed.
  none = dataclasses.replace(H100, interconnect_gbps=None)
  assert _plan(planner.Devices(2, 2), hw=none).times['interconnect'] == pytest.approx(
      two.times['interconnect'] * H100.interconnect_gbps / H100.h2d_gbps)
  # The resident step gathers all weights in every microbatch's forward and backward.
  resident = _plan(planner.Devices(2, 2), placement=Placement(), micro=1).collectives
  assert resident == {'all_gather': 2 * (W + SIZES_7B.outer_params),
                      'reduce_scatter': W + SIZES_7B.outer_params}


def test_collectives_add_to_the_device_and_to_a_shared_host_link():
  """They run in the device's calls (added to its compute); without a peer link (RTX 4090)
  they cross the host link as well."""
  fast = dataclasses.replace(H100, compute_tflops={'float32': 1e9, 'tf32': 1e9, 'bfloat16': 1e9},
                             host_adam_gparams=1e9, device_adam_gparams=1e9)
  host_opt = dataclasses.replace(STREAMED, optimizer_on='host', embed_head='host')
  own_link = _plan(planner.Devices(2, 2), placement=host_opt, hw=fast, clipping=False)
  shared = _plan(planner.Devices(2, 2), placement=host_opt, clipping=False,
                 hw=dataclasses.replace(fast, interconnect_shares_host_link=True))
  t = own_link.times
  copies = max(t['h2d'], t['d2h'])
  assert t['interconnect'] < copies  # the host link bounds the step, not the collectives
  assert own_link.step_time_s < copies + t['interconnect']
  assert shared.step_time_s >= copies + t['interconnect']
  assert hardware.PRESETS['rtx4090'].interconnect_shares_host_link
  assert not any(hardware.PRESETS[gpu].interconnect_shares_host_link
                 for gpu in ('h100', 'h200', 'a100'))


def test_devices_come_from_parallel_devices_and_the_batch_must_split():
  config = config_lib.load_config('tiny', hardware='h100', parallel__devices=2)
  assert planner.devices_for(config) == planner.Devices(2, 2)  # more than this machine has
  visible = jax.device_count()
  assert planner.devices_for(config_lib.load_config('tiny')) == planner.Devices(visible, visible)
  with pytest.raises(ConfigError, match='train.batch_size=1 does not split over 2 devices'):
    planner.devices_for(config_lib.load_config('405b', parallel__devices=2))
  plan = planner.plan_run(config, hardware.load_profile('h100'))
  assert plan.devices == planner.Devices(2, 2) and plan.batch_size == 16
  text = planner.format_plan(plan, hardware.load_profile('h100'))
  assert 'devices: 2 x h100' in text and '8 of the 16 sequences' in text


def run_launch(*args):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env.pop('XLA_FLAGS', None)  # this machine's one CPU device
  return subprocess.run([sys.executable, str(REPO_ROOT / 'launch.py'), *args], cwd=REPO_ROOT,
                        env=env, capture_output=True, text=True, timeout=300)


def test_two_device_dry_run_on_a_one_device_machine():
  result = run_launch('--config', 'tiny', '--dry_run', '--config.hardware=h100',
                      '--config.parallel.devices=2')
  assert result.returncode == 0, result.stderr
  out = result.stdout
  assert 'devices: 2 x h100, one process drives them all' in out
  assert 'device  total / available (each device)' in out and 'interconnect' in out
  last = out.strip().splitlines()
  assert last[-2].startswith('predicted_host_peak_gb: ')
  assert last[-1].startswith('predicted_step_time_s: ') and float(last[-1].split(': ')[1]) > 0


# --- where the profile came from (issue 14) -------------------------------------------------------

def test_the_plan_names_a_preset_and_how_it_was_chosen():
  hw = hardware.load_profile('h100')
  assert hw.describe().startswith("h100 (preset, config.hardware='h100'): datasheet figures")
  plan = planner.plan_run(config_lib.load_config('tiny', hardware='h100'), hw)
  assert planner.format_plan(plan, hw).splitlines()[0] == f'hardware: {hw.describe()}'


def _write_profile(path, device_kind):
  profile = dataclasses.replace(hardware.PRESETS['cpu'], name='calibrated-x',
                                device_kind=device_kind, source='calibrated on testhost at noon')
  hardware.save_profile(profile, path)
  return path


def test_an_empty_hardware_names_the_calibration_file_it_picked_up(tmp_path, monkeypatch):
  cache = tmp_path / 'hardware.json'
  monkeypatch.setattr(hardware, 'PROFILE_CACHE', cache)
  auto = hardware.load_profile('')
  assert 'auto-detected' in auto.origin and f'no calibration file at {cache}' in auto.origin
  _write_profile(cache, 'some other accelerator')
  other = hardware.load_profile('')
  assert other.name == 'cpu' and f"{cache} is for 'some other accelerator'" in other.origin
  _write_profile(cache, layout.device_kind())
  picked = hardware.load_profile('')
  assert picked.name == 'calibrated-x'
  assert f'calibration file {cache}' in picked.origin
  assert 'config.hardware is empty' in picked.origin
  plan = planner.plan_run(config_lib.load_config('tiny'), picked, disk_free_gb=10.0)
  first = planner.format_plan(plan, picked).splitlines()[0]
  assert str(cache) in first and 'calibrated on testhost' in first
  # A file named by config.hardware: its path too; the origin is never saved or read back.
  named = hardware.load_profile(str(cache))
  assert str(cache) in named.origin
  assert 'origin' not in json.loads(named.to_json())
  stored = json.loads(cache.read_text())
  cache.write_text(json.dumps({**stored, 'origin': 'forged'}))
  assert 'forged' not in hardware.load_profile(str(cache)).origin


def test_a_profile_an_earlier_calibration_wrote_is_named_so():
  """A --calibrate of an earlier version counted half the attention (and no programs_host_gb):
  its profile is used, and the plan's hardware line says to calibrate again; this version's is
  not, nor a profile that is no calibration."""
  cpu = hardware.PRESETS['cpu']
  for name, version, noted in (('calibrated-x', 0, True),
                               ('calibrated-x', hardware.CALIBRATION_VERSION, False),
                               ('my-machine', 0, False)):
    profile = dataclasses.replace(cpu, name=name, calibration_version=version)
    origin = hardware._origin(profile, 'a file').origin  # pylint: disable=protected-access
    assert ('calibrated by an earlier version of megatrain_jax' in origin) == noted, name
    assert origin.startswith('a file') and ('rerun --calibrate' in origin) == noted


# --- a refusal names the presets that would fit (issue 14) ----------------------------------------

def test_a_refusal_names_the_presets_it_would_fit():
  small = dataclasses.replace(hardware.load_profile('cpu'), device_memory_gb=16.0,
                              host_memory_gb=16.0)
  with pytest.raises(planner.NoPlacementFits) as e:
    planner.plan_run(config_lib.load_config('7b', hardware='cpu'), small, disk_free_gb=80.0)
  message = str(e.value)
  assert 'It fits these hardware presets' in message
  for preset in ('rtx4090', 'a100', 'h100', 'h200'):  # each with its sizes and fastest plan
    assert f'--config.hardware={preset} (' in message
  assert '--config.hardware=h200 (141 GB device, 2,048 GB RAM, 7,680 GB disk): ' in message
  # A caller that wants only the closest plan skips the presets' searches: same refusal, no list.
  with pytest.raises(planner.NoPlacementFits) as quiet:
    planner.plan_run(config_lib.load_config('7b', hardware='cpu'), small, disk_free_gb=80.0,
                     suggest_presets=False)
  assert str(quiet.value).splitlines()[0] == message.splitlines()[0]
  assert 'hardware preset' not in str(quiet.value)
  assert quiet.value.closest.placement == e.value.closest.placement
  # Settings that no preset can help: said so.
  with pytest.raises(planner.NoPlacementFits, match='No hardware preset .* fits it either'):
    planner.plan_run(config_lib.load_config('tiny', offload__device_memory_gb=1e-4), small,
                     disk_free_gb=80.0)


def test_a_refusal_suggests_more_devices_only_where_they_would_hold_it():
  """'shard the state over more devices' is named with the count that would hold the device rows
  (7B at 8 sequences per microbatch on an RTX 4090: 4), and not where none of 2N, 4N, 8N would:
  a batch of one sequence (it cannot split), or a device too small for what each holds whole."""
  rtx = hardware.load_profile('rtx4090')
  config = config_lib.load_config('7b', hardware='rtx4090', train__batch_size=8)
  with pytest.raises(planner.NoPlacementFits) as e:
    planner.plan_run(config, rtx, suggest_presets=False)
  assert 'shard the state over more devices (parallel.devices, now 1; 4 would hold it)' in str(
      e.value)
  fits = planner.plan_run(config, rtx, devices=planner.Devices(count=4, local=1),
                          suggest_presets=False)
  assert 'device' not in fits.over_budget()
  for name, fields in (('101b', dict(train__batch_size=1)),
                       ('tiny', dict(train__batch_size=8, offload__device_memory_gb=1e-4))):
    with pytest.raises(planner.NoPlacementFits) as e:
      planner.plan_run(config_lib.load_config(name, hardware='rtx4090', **fields), rtx,
                       suggest_presets=False)
    assert 'device memory' in str(e.value) and 'more devices' not in str(e.value), name


def test_searches_on_other_hardware_share_each_candidates_step_shape(monkeypatch):
  """A refusal searches every candidate again for each preset; what does not depend on the
  hardware (planner.StepShape) is computed once per candidate, and the plans are those of a
  search that computes its own: equal, row for row and second for second."""
  small = dataclasses.replace(hardware.load_profile('cpu'), device_memory_gb=16.0,
                              host_memory_gb=16.0)
  h100 = hardware.load_profile('h100')
  config = config_lib.load_config('7b', hardware='cpu')
  devices = planner.devices_for(config)
  computed = []
  step_shape = planner.step_shape
  monkeypatch.setattr(planner, 'step_shape',
                      lambda *a, **k: computed.append(a[2]) or step_shape(*a, **k))
  shapes = {}
  refused, *_ = planner._search(config, small, 80.0, devices, shapes)
  assert not refused and len(computed) == len(shapes) > 100  # one per candidate
  shared = planner._search(config, h100, h100.disk_gb, devices, shapes)
  assert len(computed) == len(shapes)  # none computed again
  alone = planner._search(config, h100, h100.disk_gb, devices)
  assert shared[0] and shared[0] == alone[0] and shared[1] == alone[1]
  with pytest.raises(planner.NoPlacementFits) as e:
    planner.plan_run(config, small, disk_free_gb=80.0)
  assert str(e.value).endswith(planner.presets_that_fit(config, small, devices))


def test_a_dry_run_that_fits_nowhere_names_the_presets_it_would_fit():
  result = run_launch('--config', '101b', '--dry_run', '--config.hardware=rtx4090')
  assert result.returncode == 1
  assert 'error: this config fits no placement' in result.stderr
  assert 'It fits these hardware presets' in result.stderr
  assert '--config.hardware=h200 (141 GB device' in result.stderr


# --- calibration of the interconnect --------------------------------------------------------------

def test_calibration_measures_the_all_gather_only_with_several_devices():
  assert calibrate._interconnect_gbps(1 << 20, jax.devices()[:1]) is None
  env = dict(os.environ, JAX_PLATFORMS='cpu',
             XLA_FLAGS='--xla_force_host_platform_device_count=2')
  result = subprocess.run(
      [sys.executable, '-c', 'from megatrain_jax import calibrate; '
       'print(calibrate._interconnect_gbps(4 << 20))'],
      cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  assert float(result.stdout.split()[-1]) > 0
