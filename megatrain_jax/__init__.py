"""megatrain_jax: train language models larger than accelerator memory, in true FP32."""

import os as _os

__version__ = '0.1.0'

# The host allocator first, before JAX or the data pipeline allocate or start threads (runtime.py).
from megatrain_jax import runtime as _runtime  # pylint: disable=g-import-not-at-top
_runtime.configure_from_env()

# Both settings below must be made before JAX creates its GPU client, hence here. Where JAX made
# its backends before this import (a notebook that ran JAX first), they come too late: XLA's own
# defaults are in force (75% of GPU memory, a 64 GiB pinned cap), which the planner then budgets
# (planner.device_fraction, pinned_limit_bytes), and a GPU process says so.
JAX_STARTED_FIRST = _runtime.jax_backends_exist()
XLA_DEFAULT_MEM_FRACTION, XLA_DEFAULT_PINNED_LIMIT_GB = 0.75, 64

# JAX preallocates 75% of GPU memory unless told otherwise; the planner budgets 90% of it
# (planner.device_fraction), so give XLA that much unless the user chose a fraction.
if not JAX_STARTED_FIRST:
  _os.environ.setdefault('XLA_PYTHON_CLIENT_MEM_FRACTION', '0.9')

# XLA:GPU caps its pinned host memory pool (where offload.params / opt_state = 'host' live) at
# XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB GiB, 64 unless set; raised here to this machine's RAM. The pool
# grows on demand, in regions that double and are never given back, up to the cap: the planner
# counts that growth (planner.pinned_pool_rows) and names a cap near the pinned rows where it is
# what stands in the way. A value the user set is kept, and the planner then budgets pinned memory
# against it (planner.budgets_for).
PINNED_LIMIT_ENV = 'XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB'
# Marks our value of PINNED_LIMIT_ENV, which child processes inherit.
_PINNED_LIMIT_OURS = 'MEGATRAIN_JAX_PINNED_LIMIT_AUTO'
PINNED_LIMIT_FROM_USER = (PINNED_LIMIT_ENV in _os.environ
                          and _os.environ[PINNED_LIMIT_ENV] != _os.environ.get(_PINNED_LIMIT_OURS))
if not PINNED_LIMIT_FROM_USER and not JAX_STARTED_FIRST:
  _os.environ[PINNED_LIMIT_ENV] = _os.environ[_PINNED_LIMIT_OURS] = str(
      _runtime.physical_memory_bytes() // 2 ** 30)
# On an accelerator whose client JAX made first: XLA's defaults, which the planner budgets.
XLA_DEFAULTS_IN_FORCE = JAX_STARTED_FIRST and _runtime.warn_if_gpu_started_first()
