"""One run per directory: an exclusive OS lock on the workdir (and on offload.dir when an NVMe
tier is used), held for the run's whole life.

Two runs in one workdir interleave checkpoints and metrics.jsonl; two runs on one offload.dir
rewrite each other's TensorStore chunks. So `train_and_evaluate` takes `fcntl.flock(LOCK_EX |
LOCK_NB)` on `<dir>/.megatrain.lock` after validating its inputs and before writing anything, and
a second run is refused with `DirectoryInUseError` naming the process that holds the lock (pid,
host, start time, workdir: the holder writes them into the lock file).

- The lock belongs to the open file, not to the file's existence: the OS releases it when the
  holder exits or dies, kill -9 included, so a lock file left behind never blocks a resume.
- On release the holder deletes the lock file (and the directories it created for it, if they
  are still empty: a run refused later in its start-up leaves nothing behind). That is safe with
  flock because a taker checks, once it holds the lock, that the file it locked is still the one
  at the path (same inode) and starts over otherwise.
- The holder also takes the lock on the directory itself (a descriptor of it): a lock file
  deleted while its run holds it (a tmp cleaner, a 'stale lock' removed by hand) does not let a
  second run in.
- The descriptors are close-on-exec: a subprocess of the trainer does not inherit (and keep) them.
- Network filesystems: flock on NFS is emulated with POSIX byte-range locks (Linux >= 2.6.12) and
  works between clients only where the NFS lock service does (not with the `nolock` mount
  option); Lustre honours it only when mounted with `-o flock`, CIFS/SMB and some FUSE
  filesystems only within one host. Where the filesystem refuses flock outright (ENOLCK, ENOSYS,
  EOPNOTSUPP, EINVAL) the run warns and continues unprotected; where it accepts flock but does
  not share it between hosts, two runs on different hosts are not detected. Keep offload.dir on
  a local disk (it should be anyway) and give each run its own --workdir.
- Processes of one multi-process run (issue 13) share the run's locks: only process 0 takes the
  workdir lock, and each host its own offload.dir's.

Reading a checkpoint beside the run (`--eval`, `--sample`, `--export_hf`) takes no workdir lock:
the reader holds a shared flock on the committed checkpoint directory itself (`read_hold`), and
the run, before it deletes a checkpoint beyond checkpoint.keep, tries an exclusive one on it
(`unless_read`) and keeps the checkpoint while a reader holds it (a later commit deletes it). A
reader that opens a checkpoint as the run renames it away for deletion sees another inode at the
path once it holds its lock, and takes the newest again.
"""

import contextlib
import datetime
import errno
import fcntl
import json
import os
import pathlib
import socket
import sys

from megatrain_jax import fs
from megatrain_jax.errors import ConfigError

LOCK_FILE = '.megatrain.lock'
# flock errors that mean "this filesystem does not do locks", not "someone holds it".
_UNSUPPORTED = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}


class DirectoryInUseError(ConfigError):
  """The workdir or offload.dir is locked by another run; the message names its pid and host."""


def _holder(path: pathlib.Path) -> str:
  """'pid 1234 on host h, started ..., workdir ...' from a lock file, as far as it says."""
  try:
    info = json.loads(path.read_text())
    return (f'pid {info["pid"]} on host {info["host"]}, started {info["started"]}, workdir '
            f'{info["workdir"]}')
  except (OSError, ValueError, KeyError, TypeError):
    return f'which has not written its pid into {path} yet'


class DirectoryLock:
  """The exclusive lock on one directory; `acquire` raises DirectoryInUseError (`what` names the
  directory in the message, `fix` ends it), `release` gives it back."""

  def __init__(self, directory, what: str, fix: str, workdir=None):
    self.directory = pathlib.Path(directory).expanduser().absolute()
    self.path = self.directory / LOCK_FILE
    self.what, self.fix = what, fix
    self.workdir = pathlib.Path(workdir or directory).expanduser().absolute()
    self._fd = None
    self._directory_fd = None  # the same lock on the directory itself (`_hold_directory`)
    self._created: list[pathlib.Path] = []  # directories made for the lock file, deepest last

  def _make_directory(self) -> None:
    missing = []
    path = self.directory
    while not path.exists():
      missing.append(path)
      path = path.parent
    self.directory.mkdir(parents=True, exist_ok=True)
    self._created = list(reversed(missing))

  def acquire(self) -> 'DirectoryLock':
    self._make_directory()
    while True:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as error:
        os.close(fd)
        if error.errno in _UNSUPPORTED:
          print(f'warning: cannot lock {self.what} {self.directory} ({error.strerror}: the '
                'filesystem does not support flock, e.g. NFS mounted with nolock, Lustre without '
                '-o flock); running without protection against a second run using it.',
                file=sys.stderr, flush=True)
          return self
        self._remove_created()
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
          raise DirectoryInUseError(
              f'{self.what} {self.directory} is in use by another run ({_holder(self.path)}): '
              f'wait for it, stop it, or {self.fix}.') from None
        raise
      if _same_file(fd, self.path):
        break
      os.close(fd)  # the holder deleted it as we opened it: take the new one
    self._fd = fd
    try:
      self._hold_directory()
      with fs.naming(self.path):  # os.pwrite's error names no file
        self._write_holder()
    except BaseException:  # a full disk, a directory held: the lock is given back
      self.release()
      raise
    return self

  def _hold_directory(self) -> None:
    """The exclusive lock on the directory too: a lock file deleted while its run holds it (a
    tmp cleaner, a 'stale lock' removed by hand) let a second run in beside the first, both
    writing checkpoints and stores. Where directories take no flock, the file's lock stands."""
    fd = _lock_directory(self.directory, fcntl.LOCK_EX | fcntl.LOCK_NB)
    if fd == 'busy':
      raise DirectoryInUseError(
          f'{self.what} {self.directory} is in use by another run: one reading it (a training '
          f'run on the data prepared there), or one whose {LOCK_FILE} was deleted while it ran, '
          f'so it cannot be named: wait for it, stop it, or {self.fix}.')
    self._directory_fd = fd if isinstance(fd, int) else None

  def _write_holder(self) -> None:
    started = datetime.datetime.now().astimezone().isoformat(timespec='seconds')
    info = {'pid': os.getpid(), 'host': socket.gethostname(), 'started': started,
            'workdir': str(self.workdir), 'command': ' '.join(sys.argv)}
    os.ftruncate(self._fd, 0)
    os.pwrite(self._fd, (json.dumps(info) + '\n').encode(), 0)

  def release(self) -> None:
    if self._directory_fd is not None:
      os.close(self._directory_fd)
      self._directory_fd = None
    if self._fd is None:
      self._remove_created()
      return
    try:
      if _same_file(self._fd, self.path):
        self.path.unlink()  # while still holding it; see the module docstring
    finally:
      os.close(self._fd)
      self._fd = None
    self._remove_created()

  def _remove_created(self) -> None:
    for directory in reversed(self._created):
      try:
        directory.rmdir()
      except OSError:
        break  # not empty: the run wrote something there, which is kept
    self._created = []


def _same_file(fd: int, path: pathlib.Path) -> bool:
  try:
    held, now = os.fstat(fd), os.stat(path)
  except FileNotFoundError:
    return False
  return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)


@contextlib.contextmanager
def hold(directory, what: str, fix: str, workdir=None):
  """Holds the lock on `directory` for the duration of the `with` block."""
  lock = DirectoryLock(directory, what, fix, workdir).acquire()
  try:
    yield lock
  finally:
    lock.release()


def hold_workdir(workdir):
  return hold(workdir, 'workdir', 'choose another --workdir')


def hold_offload_dir(offload_dir, workdir):
  """The offload.dir lock; none when offload.dir is the workdir itself (its lock covers it)."""
  same = pathlib.Path(offload_dir).expanduser().resolve() == pathlib.Path(workdir).resolve()
  if same:
    return contextlib.nullcontext()
  return hold(offload_dir, 'offload.dir', 'point offload.dir at another directory', workdir)


def _lock_directory(directory: pathlib.Path, operation: int):
  """An open descriptor of `directory` with `operation` (fcntl.LOCK_SH / LOCK_EX, maybe | LOCK_NB)
  taken on it; None when the directory is gone, or no longer the one at its path once locked;
  'busy' when LOCK_NB found it held; 'unsupported' when the filesystem has no flock."""
  try:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
  except FileNotFoundError:
    return None
  try:
    fcntl.flock(fd, operation)
  except OSError as error:
    os.close(fd)
    if error.errno in _UNSUPPORTED or error.errno == errno.EBADF:  # EBADF: NFS's emulation
      return 'unsupported'
    if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
      return 'busy'
    raise
  if not _same_file(fd, directory):
    os.close(fd)
    return None
  return fd


@contextlib.contextmanager
def read_hold(directory):
  """Holds a shared lock on a committed checkpoint `directory` while it is read; yields False
  (holding nothing) if it was deleted before the lock was taken. Where the filesystem has no
  flock, warns and yields True unprotected."""
  directory = pathlib.Path(directory)
  fd = _lock_directory(directory, fcntl.LOCK_SH)
  if fd == 'unsupported':
    print(f'warning: cannot lock checkpoint {directory} (the filesystem does not support flock); '
          'a run training in its workdir may delete it while it is read.', file=sys.stderr,
          flush=True)
  try:
    yield fd is not None
  finally:
    if isinstance(fd, int):
      os.close(fd)


@contextlib.contextmanager
def hold_export(directory):
  """Holds an exclusive lock on an export's destination `directory` (the directory itself: no
  lock file is left in the export) for the `with` block; DirectoryInUseError if another export
  holds it. Two exports to one directory at once published a mix of their shards, each file
  whole, which transformers loads without a word."""
  directory = pathlib.Path(directory)
  fd = _lock_directory(directory, fcntl.LOCK_EX | fcntl.LOCK_NB)
  if fd == 'busy':
    raise DirectoryInUseError(f'--export_hf: {directory} is being written by another export: '
                              'wait for it to finish, or export to another directory.')
  if fd == 'unsupported':
    print(f'warning: cannot lock {directory} (the filesystem does not support flock); a second '
          'export into it at the same time would not be refused.', file=sys.stderr, flush=True)
  try:
    yield
  finally:
    if isinstance(fd, int):
      os.close(fd)


@contextlib.contextmanager
def unless_read(directory):
  """Yields True, holding an exclusive lock on checkpoint `directory` (for its deletion), unless
  a reader holds it (`read_hold`) or it is gone: then False. True where the filesystem has no
  flock."""
  fd = _lock_directory(pathlib.Path(directory), fcntl.LOCK_EX | fcntl.LOCK_NB)
  try:
    yield isinstance(fd, int) or fd == 'unsupported'
  finally:
    if isinstance(fd, int):
      os.close(fd)
