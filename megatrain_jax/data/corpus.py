"""The embedded default training corpus.

A run with no `data.path` trains on real English text that ships inside the Python standard
library (the interactive-help topics of `pydoc`, ~465 KB), so the default works offline and needs no
file outside the Python installation.
"""

from megatrain_jax.errors import ConfigError

# Recorded in prepared-data metadata in place of a file path.
DEFAULT_CORPUS_NAME = '<embedded:pydoc_data.topics>'


def default_corpus_text() -> str:
  """Returns the default corpus: the `pydoc_data.topics` docs joined in sorted-key order.

  The text depends on the Python version (the docs change between releases); callers that cache
  derived data must therefore key it by content, not by name.

  Raises:
    ConfigError: (naming `data.path`) if this Python installation was stripped of `pydoc_data`.
  """
  try:
    # Imported lazily: the module is a large literal only the default-corpus path needs.
    from pydoc_data import topics  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ConfigError(
        'data.path: empty, so the embedded default corpus (pydoc_data.topics) is used, but this '
        'Python installation does not include pydoc_data; set data.path to a text file.') from e
  # Sorted keys: dict order is an implementation detail of how the module was generated.
  return '\n'.join(topics.topics[key] for key in sorted(topics.topics))
