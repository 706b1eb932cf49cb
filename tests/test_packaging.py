"""Issue 14: a regular install (`pip install .`, `pip install git+URL`, as on Colab) ships the
configs, so `load_config('tiny')` works without a checkout.

The wheel is built offline (no build isolation, no index) from a copy of the files it is made of,
so the checkout gets no build/ or egg-info from it. It is unzipped, which is what installing it
does, and a fresh interpreter that sees only the unzipped wheel (PYTHONPATH, cwd outside the
checkout) loads configs by bare name there.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from megatrain_jax import config as config_lib

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
# What the wheel is built from (pyproject.toml names README.md as the readme).
WHEEL_SOURCES = ('pyproject.toml', 'README.md', 'megatrain_jax', 'configs')

_INSTALLED_PROBE = r'''
import json, pathlib, sys
from megatrain_jax import config
from megatrain_jax.errors import ConfigError
own = pathlib.Path('my_run.py')  # a config file of one's own, built as docs/configs.md says
own.write_text('from configs import default\n\ndef get_config():\n'
               '  config = default.get_config()\n  config.model.d_model = 512\n  return config\n')
try:
  config.load_config('no_such_size')
  unknown = ''
except ConfigError as e:
  unknown = str(e)
print(json.dumps({
    'package': config.__file__, 'configs_dir': str(config.CONFIGS_DIR),
    'tiny': config.load_config('tiny').model.d_model,
    '125m': config.load_config('125m.py').model.to_dict(),
    'own': config.load_config('my_run.py').model.d_model,
    'unknown': unknown}))
'''


@pytest.fixture(scope='module')
def wheel(tmp_path_factory) -> pathlib.Path:
  source = tmp_path_factory.mktemp('source')
  for name in WHEEL_SOURCES:
    if (REPO_ROOT / name).is_dir():
      shutil.copytree(REPO_ROOT / name, source / name,
                      ignore=shutil.ignore_patterns('__pycache__', '*.pyc'))
    else:
      shutil.copy(REPO_ROOT / name, source / name)
  dist = tmp_path_factory.mktemp('dist')
  result = subprocess.run(
      [sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--no-build-isolation', '--no-index',
       '-q', '-w', str(dist), str(source)], capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  (path,) = dist.glob('megatrain_jax-*.whl')
  return path


def test_wheel_holds_every_module_and_the_configs(wheel):
  names = set(zipfile.ZipFile(wheel).namelist())
  assert {'megatrain_jax/configs/tiny.py', 'megatrain_jax/configs/default.py'} <= names
  # pyproject.toml lists the packages: a new subpackage missing from the list shows up here.
  package = REPO_ROOT / 'megatrain_jax'
  expected = {p.relative_to(REPO_ROOT).as_posix() for p in package.rglob('*.py')}
  expected |= {f'megatrain_jax/configs/{p.name}' for p in (REPO_ROOT / 'configs').glob('*.py')}
  assert not expected - names, f'missing from the wheel: {sorted(expected - names)}'


def test_installed_wheel_loads_configs_by_name(wheel, tmp_path):
  installed = tmp_path / 'site-packages'
  zipfile.ZipFile(wheel).extractall(installed)
  work = tmp_path / 'work'
  work.mkdir()
  env = dict(os.environ, PYTHONPATH=str(installed), JAX_PLATFORMS='cpu')
  result = subprocess.run([sys.executable, '-c', _INSTALLED_PROBE], cwd=work, env=env,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  got = json.loads(result.stdout.strip().splitlines()[-1])
  assert pathlib.Path(got['package']).is_relative_to(installed)  # not the checkout's package
  assert got['configs_dir'] == str(installed / 'megatrain_jax' / 'configs')
  assert got['tiny'] == config_lib.load_config('tiny').model.d_model
  # A preset's `from configs import default` found the installed package's default.
  assert got['125m'] == config_lib.load_config('125m').model.to_dict()
  assert got['own'] == 512
  assert 'no_such_size' in got['unknown'] and all(
      name in got['unknown'] for name in ('default', 'tiny', '125m', '101b'))


# The lent GPU machines' image has jax, flax, optax, orbax, tensorstore and numpy but neither
# ml_collections nor zstandard (/work/.library/device/KINDS.md, 2026-11-17): the GPU benchmark
# runs there as it is only if its imports need neither.
_WITHOUT_MISSING_PACKAGES = r'''
import runpy, sys
class Missing:
  def find_spec(self, name, path=None, target=None):
    if name.split('.')[0] in ('ml_collections', 'zstandard'):
      raise ImportError(f'{name}: not in the GPU image')
sys.meta_path.insert(0, Missing())
sys.argv = ['gpu_host_tier.py'] + sys.argv[1:]
runpy.run_path('bench/gpu_host_tier.py', run_name='__main__')
'''


def test_gpu_benchmark_runs_without_packages_the_gpu_image_lacks(tmp_path):
  """bench/gpu_host_tier.py's CPU smoke shape, end to end, with ml_collections and zstandard
  unimportable: both engines run, report the same loss, and the JSON the device run returns is
  written. The pinned pool's cap is the script's (its runs' pinned state), not the RAM the package
  would set: computed with the package imported first, it was the package's."""
  env = {k: v for k, v in os.environ.items()  # as a shell starts it: no cap set
         if k not in ('XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB', 'MEGATRAIN_JAX_PINNED_LIMIT_AUTO')}
  env['PYTHONPATH'] = str(REPO_ROOT)
  # One precision: on CPU both compile the same arithmetic (the GPU run does both by default).
  result = subprocess.run([sys.executable, '-c', _WITHOUT_MISSING_PACKAGES, '--models', 'tiny',
                           '--steps', '1', '--warmup', '1', '--precisions', 'highest', '--out',
                           str(tmp_path)], cwd=REPO_ROOT, env=env, check=True,
                          capture_output=True, text=True, timeout=600)
  assert 'XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=2;' in result.stdout.replace('\n', ';'), result.stdout
  rows = json.loads((tmp_path / 'gpu_host_tier.json').read_text())
  assert [(r['precision'], r['engine']) for r in rows] == [
      ('highest', 'resident'), ('highest', 'streamed-host')]
  resident_row, streamed_row = rows
  assert abs(streamed_row['loss'] - resident_row['loss']) <= 1e-5 * abs(resident_row['loss'])
  assert streamed_row['io/h2d_gb'] > 0 and streamed_row['step_s'] > 0
  # The process's host memory (what the plan's pinned pool row predicts on a GPU), measured.
  assert 0.1 < resident_row['host_rss_gb'] <= streamed_row['host_peak_gb'] < 16


def test_gpu_benchmark_counts_the_layers_as_the_model_does():
  """bench/gpu_host_tier.py counts the layer parameters itself (importing the package first would
  set XLA's environment before the script could) for its pinned cap: the same count as
  ModelConfig for every shape it runs."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  from megatrain_jax.model import ModelConfig  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location('gpu_host_tier',
                                                REPO_ROOT / 'bench' / 'gpu_host_tier.py')
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  for name, shape in bench.MODELS.items():
    cfg = ModelConfig(**shape)
    assert bench.layer_params(shape) == cfg.num_layers * cfg.params_per_layer, name
  assert bench.pinned_limit_gib(['7b']) == 81  # 72.4 GiB of layer params and Adam m, v + 10%
