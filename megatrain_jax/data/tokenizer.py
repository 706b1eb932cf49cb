"""Tokenizers: a dependency-free byte tokenizer and local Hugging Face `tokenizer.json` files.

Both expose the same small interface (`Tokenizer`), which is all the prepare step, the trainer and
the samplers rely on. Nothing here downloads: a Hugging Face tokenizer must already be on disk.
"""

import functools
import hashlib
import re
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np
import tokenizers

from megatrain_jax.errors import ConfigError

# Token ids never reach 2**31 for any real vocabulary, and int32 is what the model consumes.
_ID_DTYPE = np.int32


class Tokenizer(Protocol):
  """The interface every tokenizer in this package implements."""

  @property
  def name(self) -> str:
    """A stable identity string; it changes whenever the id mapping could change."""

  @property
  def vocab_size(self) -> int:
    """Number of distinct ids; every id returned by `encode` is below it."""

  def encode(self, text: str) -> np.ndarray:
    """Returns the 1-D integer token ids of `text`."""

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """Returns the text of `ids`."""


def decode_continuation(tokenizer: Tokenizer, prompt: Sequence[int],
                        ids: Sequence[int] | np.ndarray) -> str:
  """The text `ids` add after `prompt`: the whole decoded, cut where the prompt's text ends, as
  transformers' text-generation pipeline cuts it. Decoded alone, a Metaspace tokenizer's first
  new token loses its space ('▁the' -> 'the': 'France isthe'), the decoder stripping it as a
  text's first."""
  before = tokenizer.decode(list(prompt))
  whole = tokenizer.decode([*prompt, *np.asarray(ids).reshape(-1).tolist()])
  return whole[len(before):] if whole.startswith(before) else tokenizer.decode(ids)


def encode_batch(tokenizer: Tokenizer, texts: Sequence[str]) -> list[Sequence[int]]:
  """The ids of each text: the tokenizer's own `encode_batch` where it has one (one call into
  the Rust tokenizer for the whole batch), else `encode` text by text."""
  batch = getattr(tokenizer, 'encode_batch', None)
  if batch is not None:
    return batch(texts)
  return [tokenizer.encode(text) for text in texts]


# Long text is encoded in pieces of about this many characters: a Hugging Face tokenizer's working
# memory grows with the text it is given (~16 bytes of alignment per byte, each token's string and
# offsets), ~300x the text at once; a piece keeps it to tens of MB.
PIECE_CHARS = 1 << 18
# Where text may be cut: before a space between two letters ('the| cat'), or after a newline
# between two non-blank characters ('end.\n|Next'; text without spaces, such as Chinese, has
# those). The common pre-tokenizers (ByteLevel with GPT-2's, Llama 3's or Qwen's pattern,
# Whitespace, BERT's, Metaspace) split there anyway, so the pieces encode to the ids of the text
# whole. Each cut is also checked on the text around it (_CHECK_CHARS each side), which turns
# down the tokenizers that do not split there (one whose normalizer prepends '▁' to every text).
_CUT = re.compile(r'(?<=[^\W\d_])(?= [^\W\d_])|(?<=\S\n)(?=\S)')
_CHECK_CHARS = 64
# Candidates checked before giving up on cutting a text (the rest is then encoded whole).
_CUT_TRIES = 8


def cut_point(tokenizer: Tokenizer, text: str, start: int) -> int:
  """The first cut (_CUT) at or after `start` where encoding the text on each side apart gives
  the ids of encoding it together, or -1 if none passes that check within _CUT_TRIES."""
  for tries, match in enumerate(_CUT.finditer(text, start)):
    at = match.start()
    if tries >= _CUT_TRIES:
      return -1
    lo = max(0, at - _CHECK_CHARS)
    left, right, both = encode_batch(
        tokenizer, [text[lo:at], text[at:at + _CHECK_CHARS], text[lo:at + _CHECK_CHARS]])
    if list(left) + list(right) == list(both):
      return at
  return -1


def text_cuts(tokenizer: Tokenizer, text: str, piece_chars: int | None = None) -> list[int]:
  """Where the pieces of `text` begin ([0, ...]): every `piece_chars` (default PIECE_CHARS)
  or so, at a cut `cut_point` finds the ids unchanged by (no cut found: the rest one piece)."""
  piece_chars = piece_chars or PIECE_CHARS
  starts = [0]
  while len(text) - starts[-1] > 2 * piece_chars:  # no cut leaves a piece of a few characters
    at = cut_point(tokenizer, text, starts[-1] + piece_chars)
    if at < 0:
      break
    starts.append(at)
  return starts


def is_long(text: str) -> bool:
  """Whether `text` is encoded in pieces (`encode_text`) rather than whole."""
  return len(text) > 2 * PIECE_CHARS


def encode_text(tokenizer: Tokenizer, text: str, piece_chars: int | None = None) -> np.ndarray:
  """The ids of `text` ([N] int32), those of `tokenizer.encode(text)`, in bounded memory: encoded
  in the pieces `text_cuts` gives."""
  bounds = [*text_cuts(tokenizer, text, piece_chars), len(text)]
  ids = [ids_array(encode_batch(tokenizer, [text[start:end]])[0])
         for start, end in zip(bounds, bounds[1:])]
  return ids[0] if len(ids) == 1 else np.concatenate(ids)


def ids_array(ids: Sequence[int] | bytes) -> np.ndarray:
  """`encode_batch`'s ids of one text as an int32 array."""
  if isinstance(ids, bytes):  # the byte tokenizer's
    return np.frombuffer(ids, np.uint8).astype(_ID_DTYPE)
  return np.asarray(ids, _ID_DTYPE)


class ByteTokenizer:
  """Maps text to its UTF-8 bytes: 256 ids, no vocabulary file, lossless on any text."""

  @property
  def name(self) -> str:
    return 'byte'

  @property
  def vocab_size(self) -> int:
    return 256

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode('utf-8'), dtype=np.uint8).astype(_ID_DTYPE)

  def encode_batch(self, texts: Sequence[str]) -> list[bytes]:
    # bytes are a sequence of ints in [0, 255]: exactly the ids.
    return [text.encode('utf-8') for text in texts]

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    # A silent uint8 wrap-around would turn id 300 into byte 44 and hide a model/vocab mismatch.
    if ids.size and (ids.min() < 0 or ids.max() > 255):
      raise ValueError(f'ByteTokenizer.decode: ids must be in [0, 255], got range '
                       f'[{ids.min()}, {ids.max()}]')
    # Sampled byte sequences can cut a multi-byte character in half; show U+FFFD, don't fail.
    return ids.astype(np.uint8).tobytes().decode('utf-8', errors='replace')


def _panics_named(method):
  """`method` of an HFTokenizer, a panic of the Rust library (pyo3's PanicException, a
  BaseException that no `except Exception` catches: a pre-tokenizer regex that backtracks past
  Oniguruma's retry limit panics on some texts) a ConfigError naming the tokenizer file."""
  @functools.wraps(method)
  def named(self, *args, **kwargs):
    try:
      return method(self, *args, **kwargs)
    except BaseException as e:  # pylint: disable=broad-exception-caught
      if type(e).__name__ != 'PanicException':
        raise
      raise ConfigError(
          f'data.tokenizer: {self.path} failed on a text: the tokenizers library panicked '
          f'({str(e).strip()}), as a pre-tokenizer or normalizer regex that backtracks without '
          'end makes it; fix its tokenizer.json (the Split or Replace pattern) or use another '
          'tokenizer.') from None
  return named


class HFTokenizer:
  """A Hugging Face `tokenizers` tokenizer loaded from a local `tokenizer.json`.

  Attributes:
    path: The resolved path of the `tokenizer.json` file.
  """

  def __init__(self, path: str | Path):
    """Loads the tokenizer.

    Args:
      path: A `tokenizer.json` file, or a directory that contains one.

    Raises:
      ConfigError: (naming `data.tokenizer`) if the file is missing or cannot be parsed.
    """
    self.path = _resolve_tokenizer_file(path)
    try:
      self._tokenizer = _panics_named(lambda self: tokenizers.Tokenizer.from_file(
          str(self.path)))(self)
    except ConfigError:
      raise
    except Exception as e:  # The Rust binding raises a bare Exception for any parse error.
      raise ConfigError(
          f'data.tokenizer: could not load {self.path} as a Hugging Face tokenizer.json ({e}); '
          f"point data.tokenizer at a valid tokenizer.json or use 'byte'.") from e
    # Identity by content, not by path: moving a checkpoint's tokenizer must not invalidate
    # prepared data, while editing the file in place must.
    digest = hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]
    self._name = f'hf:{digest}'

  @property
  def name(self) -> str:
    return self._name

  @property
  def vocab_size(self) -> int:
    return self._tokenizer.get_vocab_size(with_added_tokens=True)

  @_panics_named
  def encode(self, text: str) -> np.ndarray:
    # Pretraining streams are concatenations of chunks; a BOS/EOS per chunk would be noise.
    ids = self._tokenizer.encode(text, add_special_tokens=False).ids
    return np.asarray(ids, dtype=_ID_DTYPE)

  @_panics_named
  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    # encode_batch_fast skips the character offsets, which the prepare step never uses.
    return [e.ids for e in self._tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)]

  @_panics_named
  def encodings(self, texts: Sequence[str]) -> list[tokenizers.Encoding]:
    """Each text's `tokenizers.Encoding` (ids, and where each character went: char_to_token),
    without special tokens added."""
    return self._tokenizer.encode_batch(list(texts), add_special_tokens=False)

  def token_id(self, token: str) -> int | None:
    """The id of `token` (a vocabulary entry or added token such as '</s>'), or None."""
    return self._tokenizer.token_to_id(token)

  @_panics_named
  def added_prefix(self) -> list[int]:
    """The ids the tokenizer's post-processor puts before a text when special tokens are added
    (Llama 3's <|begin_of_text|>); [] if none."""
    plain = self._tokenizer.encode('a', add_special_tokens=False).ids
    full = self._tokenizer.encode('a', add_special_tokens=True).ids
    for i in range(len(full) - len(plain) + 1):
      if full[i:i + len(plain)] == plain:
        return full[:i]
    return []

  @_panics_named
  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    return self._tokenizer.decode(ids, skip_special_tokens=False)


def _resolve_tokenizer_file(path: str | Path) -> Path:
  """Returns the `tokenizer.json` file named by `path` (a file or a directory holding one)."""
  path = Path(path).expanduser()
  if path.is_dir():
    path = path / 'tokenizer.json'
  if not path.is_file():
    raise ConfigError(
        f'data.tokenizer: {path} does not exist; set data.tokenizer to a local tokenizer.json '
        f"(or a directory containing one), or to 'byte' for the built-in byte tokenizer.")
  return path.resolve()


def check_tokenizer_spec(spec: str) -> None:
  """Checks that `spec` names a tokenizer that exists, without loading it.

  Raises:
    ConfigError: (naming `data.tokenizer`) if `spec` is empty or a path that does not exist.
  """
  if not isinstance(spec, str) or not spec:
    raise ConfigError(f"data.tokenizer: got {spec!r}; set it to 'byte' or to the path of a local "
                      'tokenizer.json.')
  if spec != 'byte':
    _resolve_tokenizer_file(spec)


def load_tokenizer(spec: str) -> Tokenizer:
  """Returns the tokenizer named by `spec`: 'byte' or a path to a local `tokenizer.json`.

  Raises:
    ConfigError: (naming `data.tokenizer`) if the path is missing or not a valid tokenizer.json.
  """
  check_tokenizer_spec(spec)
  if spec == 'byte':
    return ByteTokenizer()
  path = _resolve_tokenizer_file(spec)
  stat = path.stat()
  return _load_hf(path, (stat.st_ino, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=4)
def _load_hf(path: Path, version: tuple) -> HFTokenizer:
  """The tokenizer of `path` as it is now (`version`: its inode, mtime and size, so a file
  written again is loaded again): a run's start asks for it several times (the model's check,
  then the data), and a 152k vocabulary takes ~0.3 s to parse each time."""
  del version
  return HFTokenizer(path)
