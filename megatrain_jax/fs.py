"""File-system helpers shared by the checkpointer, the NVMe tier, the data prepare step and config
checks: names for tree paths on disk, atomic writes, fsync, crc32, hard-link trees, free space."""

import contextlib
import errno
import json
import os

import numpy as np
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import zlib

from megatrain_jax.errors import ConfigError


def leaf_name(path: str) -> str:
  """Tree path -> file-system name: "['opt_state'][0].mu['layers']['w']" ->
  "opt_state.0.mu.layers.w"."""
  return re.sub(r'[^A-Za-z0-9_]+', '.', path).strip('.')


def human_bytes(n: float) -> str:
  return f'{n / 1e9:,.2f} GB' if n >= 1e9 else f'{n / 1e6:,.2f} MB'


def json_loads(text: str | bytes):
  """json.loads, where JSON nested deeper than Python's parser goes (200,000 '[' in a line: a
  RecursionError, which no caller's `except ValueError` caught) a JSONDecodeError as other
  malformed JSON is."""
  try:
    return json.loads(text)
  except RecursionError:
    raise json.JSONDecodeError('nested deeper than Python reads JSON (its recursion limit, '
                               f'{sys.getrecursionlimit():,} levels)', '', 0) from None


def read_at_most(path, limit: int, field: str, fix: str, stream=None) -> bytes:
  """The bytes of file `path` (or of `stream`: its decompressed bytes), refused where there are
  more than `limit` (ConfigError naming `field`, the file, its size, the limit and `fix`), with
  no more than `limit` read: a file another party gave is not read whole into memory."""
  path = pathlib.Path(path)
  if stream is None:
    with open(path, 'rb') as f:
      return read_at_most(path, limit, field, fix, f)
  data = stream.read(limit + 1)
  if len(data) > limit:
    size = path.stat().st_size
    grown = ' (more decompressed)' if size <= limit else ''
    raise ConfigError(f'{field}: {path} is {size:,} bytes{grown}, more than the {limit:,} '
                      f'read at most; {fix}.')
  return data


# The largest JSON file of metadata another party gave that is read whole (config.json,
# tokenizer_config.json, generation_config.json, a weight index): KB to a few MB.
MAX_METADATA_BYTES = 64 << 20


def read_json_at_most(path, field: str, fix: str, limit: int | None = None):
  """The JSON in file `path`, read at most `limit` bytes (MAX_METADATA_BYTES; `read_at_most`:
  more is a ConfigError naming `field`, the file, its size and `fix`), nested as deep as
  `json_loads` allows.

  Raises:
    ConfigError: for a file over `limit`.
    OSError, UnicodeDecodeError, json.JSONDecodeError: for the caller to name.
  """
  return json_loads(read_at_most(path, limit or MAX_METADATA_BYTES, field, fix).decode())


def nearest_existing(path: pathlib.Path) -> pathlib.Path:
  """`path` or its closest existing ancestor: what a later mkdir would create inside."""
  while not path.exists():
    path = path.parent
  return path


def check_writable(path, field: str, fix: str, why: str = '', needed_bytes: int = 0,
                   what: str = 'it') -> pathlib.Path:
  """`path` absolute, once the directory it is in or will be created in (its nearest existing
  one) is found writable, on a filesystem mounted read-write, with `needed_bytes` free (for
  `what`); else a ConfigError that starts with `field` and ends with `fix`. Writes nothing: a
  job checks where it will write before it computes what it writes there."""
  path = pathlib.Path(path).expanduser().absolute()
  existing = nearest_existing(path)
  if not existing.is_dir():
    raise ConfigError(f'{field}: {existing} is a file, not a directory. {fix}')
  if os.statvfs(existing).f_flag & os.ST_RDONLY:  # EROFS: no permission fixes that
    raise ConfigError(f'{field}: {existing} is on a read-only filesystem{why}. {fix}')
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ConfigError(f'{field}: {existing} is not writable{why}. {fix[:-1]}, or fix its '
                      'permissions.')
  free = shutil.disk_usage(existing).free
  if free < needed_bytes:
    raise ConfigError(f'{field}: {what} needs {human_bytes(needed_bytes)} in {existing}, and '
                      f'{human_bytes(free)} are free there. Free space there, or {fix[0].lower()}'
                      f'{fix[1:]}')
  return path


def is_disk_full(error: BaseException) -> bool:
  """ENOSPC as raised by the OS, or as reported in TensorStore's / orbax's error text."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
      return True
    if 'No space left on device' in str(error) or 'Disk quota exceeded' in str(error):
      return True
    error = error.__cause__ or error.__context__
  return False


def inside(directory: pathlib.Path, name: str) -> pathlib.Path:
  """`directory / name`, for a name another file gives (an index's shard, a manifest's entry, a
  saved dataset's file): relative, without '..', and, its symlinks followed, inside `directory`,
  or inside the blobs/ of the Hugging Face cache repository `directory` is a snapshot of
  (snapshots/<rev>/x -> ../../blobs/<hash>). The file need not exist.

  Raises:
    ValueError: saying why not (the caller names the file that gave `name`, and the fix).
  """
  if not isinstance(name, str) or not name:
    raise ValueError(f'{name!r} is not a file name')
  parts = pathlib.PurePath(name).parts
  if pathlib.PurePath(name).is_absolute() or '..' in parts:
    raise ValueError(f'{name!r} is not a name inside the directory (absolute, or with "..")')
  path = pathlib.Path(directory) / name
  real, root = path.resolve(), pathlib.Path(directory).resolve()
  roots = [root] + ([root.parent.parent / 'blobs'] if root.parent.name == 'snapshots' else [])
  if not any(real.is_relative_to(r) for r in roots):
    raise ValueError(f'{name} is a link to {real}, outside {directory}')
  return path


def inside_or_refuse(directory: pathlib.Path, name: str, message: str) -> pathlib.Path:
  """`inside`, a name outside refused with a ConfigError: `message`, its '{reason}' the why (a
  replace, not str.format: the paths in the message may hold braces)."""
  try:
    return inside(directory, name)
  except ValueError as e:
    raise ConfigError(message.replace('{reason}', str(e))) from e


def fsync(path: pathlib.Path, directory: bool = False) -> None:
  """Makes a file's data (or, for a directory, its renames and unlinks) durable."""
  fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def crc32(path: pathlib.Path) -> int:
  crc = 0
  with open(path, 'rb') as f:
    while block := f.read(1 << 22):
      crc = zlib.crc32(block, crc)
  return crc


@contextlib.contextmanager
def naming(path):
  """An OSError raised in the block names `path` when it names no file (a file object's write or
  flush, os.pwrite): a full disk's error then says which disk (train._disk_full_is_an_error)."""
  try:
    yield
  except OSError as error:
    error.filename = error.filename or str(path)
    raise


def new_temp(directory: pathlib.Path, name: str) -> pathlib.Path:
  """Creates an empty hidden temp file beside `directory / name` (same filesystem for replace),
  with the mode open() gives a new file (0o666 less the umask; mkstemp's is 0o600, which would
  make a run's files unreadable to the rest of a team once renamed into place)."""
  fd, path = tempfile.mkstemp(dir=directory, prefix=f'.{name}.', suffix='.tmp')
  try:
    os.fchmod(fd, 0o666 & ~umask())
  finally:
    os.close(fd)
  return pathlib.Path(path)


def umask() -> int:
  """The process's umask, read without changing it (Linux /proc; else set and set back)."""
  try:
    for line in pathlib.Path('/proc/self/status').read_text().splitlines():
      if line.startswith('Umask:'):
        return int(line.split()[1], 8)
  except (OSError, ValueError):
    pass
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def write_text_atomic(path: pathlib.Path, text: str) -> None:
  """Writes `text` to a temp file beside `path`, fsyncs it and renames it over `path`: a reader
  sees the old file or the new one, never a torn one, even across a crash."""
  path = pathlib.Path(path)
  with naming(path):  # a write's or fsync's error names none: then `path`
    _write_text_atomic(path, text)


def _write_text_atomic(path: pathlib.Path, text: str) -> None:
  tmp = new_temp(path.parent, path.name)
  try:
    with open(tmp, 'w', encoding='utf-8') as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync(path.parent, directory=True)
  finally:
    tmp.unlink(missing_ok=True)


def write_json_atomic(path: pathlib.Path, obj) -> None:
  write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + '\n')


def link_tree(source: pathlib.Path, dest: pathlib.Path, existing_ok: bool = False) -> int:
  """Hard-links every file under `source` into `dest` (same relative paths), copying where a link
  is impossible (EXDEV across filesystems, or a filesystem without links). TensorStore temp files
  (*.__lock) are skipped. `existing_ok`: a file already in `dest` is left as it is (several
  processes linking their own parts of one array, each with the same metadata file). Returns the
  bytes copied (0 when everything was linked)."""
  copied = 0
  for root, _, files in os.walk(source):
    target = dest / os.path.relpath(root, source)
    target.mkdir(parents=True, exist_ok=True)
    for name in files:
      if not name.endswith('.__lock'):
        copied += link_file(pathlib.Path(root) / name, target / name, existing_ok)
  return copied


def link_file(source: pathlib.Path, dest: pathlib.Path, existing_ok: bool = False) -> int:
  """Hard-links `source` at `dest` (its directory must exist), copying where a link is impossible;
  returns the bytes copied. `existing_ok`: a `dest` already there is left as it is."""
  try:
    os.link(source, dest)
  except FileExistsError:
    if not existing_ok:
      raise
  except OSError as error:
    if error.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
      raise
    shutil.copyfile(source, dest)  # streams in blocks: no whole-file buffer
    return os.path.getsize(dest)
  return 0


def drop_page_cache() -> bool:
  """sync + drop the page cache, dentries and inodes (benchmarks of cold reads). False where not
  permitted (not root)."""
  os.sync()  # dirty pages cannot be dropped: write them back first
  try:
    with open('/proc/sys/vm/drop_caches', 'w') as f:
      f.write('3\n')
    return True
  except OSError:
    return False


def cached_bytes(paths) -> int | None:
  """Bytes of `paths` resident in the page cache (util-linux `fincore`); None if unavailable."""
  paths = [str(p) for p in paths]
  if not paths or shutil.which('fincore') is None:
    return None
  out = subprocess.run(['fincore', '--bytes', '--noheadings', '--raw', '--output', 'RES', *paths],
                       capture_output=True, text=True)
  if out.returncode != 0:
    return None
  return sum(int(line) for line in out.stdout.split())


def aligned_empty(shape, dtype, alignment: int = 64) -> np.ndarray:
  """np.empty(shape, dtype) starting on an `alignment`-byte boundary. XLA:CPU adopts such a buffer
  without copying (`jax.device_put` aliases it); a less aligned one (TensorStore's read results
  are 16-byte aligned) is copied, so every piece read from disk would briefly exist twice."""
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape)) * dtype.itemsize
  raw = np.empty(nbytes + alignment, np.uint8)
  offset = -raw.ctypes.data % alignment
  return raw[offset:offset + nbytes].view(dtype).reshape(shape)
