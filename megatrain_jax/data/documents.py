"""Documents: how a record becomes tokens and a loss mask.

Every record of a `.jsonl(.zst|.gz)` or `.parquet` source is one document, stored as

  [BOS] tokens(document) EOS

BOS only where the tokenizer's config adds one (`add_bos_token: true` in tokenizer_config.json, or a
post-processor that prepends a token, as Llama 3's does). EOS is `data.eos_token` if set, else the
`eos_token` of the `tokenizer_config.json` beside `tokenizer.json`.

The byte tokenizer's rule: it has no spare ids (all 256 are bytes), so EOS is byte 0 (NUL), which
never occurs in text (the prepare step refuses a NUL in a text file, and a record whose text holds
one is a bad record); it adds no BOS. `data.eos_token` may name another single-byte character.

A record is read as (first match wins):
  instruction  it holds `data.prompt_field` and `data.completion_field` (strings): the prompt is
               not learned (mask 0), the completion and the EOS after it are (mask 1); both
               lists of {role, content} (TRL's conversational prompt-completion): the
               conversation prompt + completion as chat, learning only the completion's
               assistant turns;
  text         it holds `data.text_field` (a string): every token is learned;
  chat         it holds `messages` (a list of {role, content}) or ShareGPT's `conversations` (a
               list of {from, value}; from: human, gpt, system, ...) and the tokenizer directory
               has a chat template: the conversation is rendered with it (jinja2 sandbox), with
               the record's `tools` (function schemas) if any, and only the assistant turns (and
               the EOS) are learned; an assistant turn may hold `tool_calls` instead of content;
  alpaca       it holds `instruction` and `output` (Alpaca; Dolly's `response` for `output`),
               with an optional `input` (Dolly: `context`) and `system`: with a chat template,
               a user turn of the instruction (and input, after a blank line) and the output as
               the assistant's reply, rendered and learned as chat; without one, Stanford
               Alpaca's prompt text (`ALPACA_PROMPT`) as the prompt, the output learned
               (a record that also holds `text`, as tatsu-lab/alpaca's rows do, is text).
In instruction and chat documents BOS is not learned; plain text documents learn every token
(no mask is stored for them). Plain .txt sources are not records: their bytes are one continuous
stream, tokenized as is (no BOS/EOS), as before this format existed.

The loss mask stored beside the tokens says, for each token, whether it is learned as a target
(1) or not (0).
"""

import dataclasses
import functools
import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from megatrain_jax import fs
from megatrain_jax.data import chat_sandbox
from megatrain_jax.data.tokenizer import (ByteTokenizer, Tokenizer, encode_batch, encode_text,
                                          ids_array, is_long, text_cuts)
from megatrain_jax.errors import ConfigError

MESSAGES_FIELD = 'messages'
SHAREGPT_FIELD = 'conversations'
TOOLS_FIELD = 'tools'
# The rules that read records (record_parts): raised when a kind of record that was bad becomes
# readable.
RECORDS_VERSION = 5
# How a chat template's rendering becomes a document (chat_parts), part of the prepared data's
# identity where the template writes bos_token or eos_token (the ones it changed): 2 = the
# template's own first BOS and last EOS are the document's (they were doubled before), so such
# data prepared before is prepared again (other data, large corpora included, is not).
CHAT_RENDERING_VERSION = 2
# How records that learn only some of their tokens (pairs, chats) become tokens and masks, part
# of the prepared data's identity. 2: every token of a learned character that a byte-level BPE
# splits (an emoji's 4 bytes), not only its first; a chat whose template ends every turn with the
# EOS (Qwen2.5 Instruct's '<|im_end|>') ends at the last turn's, not '<|im_end|>\n<|im_end|>';
# multi-turn Phi-3 chats are read; a template's own BOS is tokenized with the text after it.
# Data prepared before with a loss mask is prepared again; data without one (text, a corpus of
# JSONL text) is kept (prepare._fingerprint_before_learned_rules).
LEARNED_RULES_VERSION = 2
LEARNED_RULES_FIELD = 'learned_rules'
# Alpaca records (record_parts): the field names (where two, Alpaca's, then Dolly's).
ALPACA_INSTRUCTION = 'instruction'
ALPACA_OUTPUT = ('output', 'response')
ALPACA_INPUT = ('input', 'context')
# Stanford Alpaca's prompts (tatsu-lab/stanford_alpaca, train.py: PROMPT_DICT), for tokenizers
# without a chat template: with an input, and without. The output follows the colon directly, as
# there.
ALPACA_PROMPT = ('Below is an instruction that describes a task, paired with an input that '
                 'provides further context. Write a response that appropriately completes the '
                 'request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n'
                 '### Response:')
ALPACA_PROMPT_NO_INPUT = ('Below is an instruction that describes a task. Write a response that '
                          'appropriately completes the request.\n\n### Instruction:\n'
                          '{instruction}\n\n### Response:')
_TOKENIZER_CONFIG = 'tokenizer_config.json'
# transformers' file for a tokenizer's chat template, beside tokenizer.json.
CHAT_TEMPLATE_FILE = 'chat_template.jinja'


class BadRecord(ValueError):
  """A record that cannot become a document; the message says why (the caller adds file:line)."""


@dataclasses.dataclass(frozen=True)
class DocumentFormat:
  """What the prepare step needs to turn records into tokens (picklable: sent to workers).

  Attributes:
    eos: The id stored after every document.
    bos: The id stored before every document, or None.
    text_field, prompt_field, completion_field: Record fields (config `data.*`).
    chat_template: The tokenizer's chat template (jinja2 source), or None.
    bos_text, eos_text: The special tokens' strings, for the chat template.
    skip_bad_records: Skip (and count) bad records instead of failing.
    refuse_nul: The byte tokenizer's EOS is NUL: a text holding NUL is a bad record.
    text_documents: Each text file is one document, [BOS] text EOS (data.text_documents), not
      a piece of one continuous stream.
  """
  eos: int
  bos: int | None = None
  text_field: str = 'text'
  prompt_field: str = 'prompt'
  completion_field: str = 'completion'
  chat_template: str | None = None
  bos_text: str = ''
  eos_text: str = ''
  skip_bad_records: bool = False
  refuse_nul: bool = False
  text_documents: bool = False

  def identity(self) -> dict[str, Any]:
    """What decides the prepared tokens (part of the prepared data's fingerprint)."""
    out = dataclasses.asdict(self)
    if not out['text_documents']:  # data prepared before the field existed stays valid
      del out['text_documents']
    if self.skip_bad_records:
      # Records read since version 2 (ShareGPT, conversational prompt/completion, tool calls),
      # 3 (Alpaca), 4 (JSON lines with null fields, read as Parquet rows are) and 5 (chats
      # whose template rewrites earlier turns: Qwen3's thinking) were bad records before,
      # skipped where this is set: prepare such data again.
      out['records_version'] = RECORDS_VERSION
    template = out.pop('chat_template')
    out['chat_template_sha256'] = (hashlib.sha256(template.encode()).hexdigest()
                                   if template else None)
    if template and ('bos_token' in template or 'eos_token' in template):
      out['chat_rendering'] = CHAT_RENDERING_VERSION
    out[LEARNED_RULES_FIELD] = LEARNED_RULES_VERSION
    return out


def token_text(value: Any) -> str | None:
  """A special token from tokenizer_config.json: a string or {'content': ...}."""
  if isinstance(value, dict):
    value = value.get('content')
  return value if isinstance(value, str) and value else None


# The largest tokenizer_config.json read (read whole; the largest known are a few MB).
MAX_TOKENIZER_CONFIG_BYTES = fs.MAX_METADATA_BYTES


def read_tokenizer_config(tokenizer: Tokenizer) -> dict[str, Any]:
  """The tokenizer_config.json beside the tokenizer's tokenizer.json ({} if none)."""
  path = getattr(tokenizer, 'path', None)
  if path is None:
    return {}
  config_path = Path(path).parent / _TOKENIZER_CONFIG
  if not config_path.is_file():
    return {}
  try:
    config = fs.read_json_at_most(
        config_path, 'data.tokenizer',
        f'a {_TOKENIZER_CONFIG} is KB to a few MB: replace it with the model\'s own',
        MAX_TOKENIZER_CONFIG_BYTES)
  except ConfigError:
    raise
  except (OSError, ValueError) as e:
    raise ConfigError(f'data.tokenizer: {config_path} is not valid JSON ({e}); fix or remove '
                      'it.') from e
  return config if isinstance(config, dict) else {}


# The longest chat template read (the longest known are tens of KB).
MAX_TEMPLATE_CHARS = 1 << 20


def read_chat_template(path: str | Path, field: str = 'data.chat_template') -> str:
  """The chat template (jinja2 source) in file `path`: data.chat_template's, or (`field`
  'data.tokenizer') a tokenizer's chat_template.jinja.

  Raises:
    ConfigError: (naming `field`) if it is unreadable, not UTF-8, empty or not a template jinja2
      compiles.
  """
  fix = ("point it at a chat template file, or set it to '' for the tokenizer's own"
         if field == 'data.chat_template' else 'fix or remove it, or set data.chat_template')
  try:
    if not Path(path).is_file():  # /dev/zero, a FIFO: read whole, it would never end
      raise OSError(f'{path} is not a regular file')
    with open(path, encoding='utf-8') as f:  # as read_text reads it (newlines translated)
      template = f.read(MAX_TEMPLATE_CHARS + 1)
    if len(template) > MAX_TEMPLATE_CHARS:
      raise OSError(f'more than {MAX_TEMPLATE_CHARS:,} characters; chat templates are a few KB')
  except (OSError, UnicodeDecodeError) as e:
    raise ConfigError(f'{field}: cannot read {path} as a UTF-8 jinja file ({e}); {fix}.') from e
  if not template.strip():
    raise ConfigError(f'{field}: {path} is empty; {fix}.')
  try:
    chat_sandbox.compiled(template)
  except Exception as e:  # jinja2's TemplateSyntaxError and its kin
    raise ConfigError(f'{field}: {path} is not a valid jinja2 template ({e}); {fix}.') from e
  return template


def _chat_template(config: dict[str, Any], directory: Path | None) -> str | None:
  """The tokenizer's chat template: CHAT_TEMPLATE_FILE beside its tokenizer.json (transformers
  saves it there since 4.5x and prefers it when loading), else tokenizer_config.json's
  `chat_template` (a string, or named templates, of which 'default')."""
  if directory is not None and (directory / CHAT_TEMPLATE_FILE).is_file():
    return read_chat_template(directory / CHAT_TEMPLATE_FILE, 'data.tokenizer')
  template = config.get('chat_template')
  if isinstance(template, list):  # [{'name': 'default', 'template': ...}, ...]
    named = {t.get('name'): t.get('template') for t in template if isinstance(t, dict)}
    template = named.get('default')
  return template if isinstance(template, str) and template else None


def _byte_format(eos_token: str, fields: dict[str, Any]) -> DocumentFormat:
  eos_text = eos_token or '\0'
  encoded = eos_text.encode('utf-8')
  if len(encoded) != 1:
    raise ConfigError(f'data.eos_token: got {eos_token!r}; with the byte tokenizer it must be a '
                      "single-byte character (or '' for the default, NUL).")
  return DocumentFormat(eos=encoded[0], eos_text=eos_text, refuse_nul=encoded[0] == 0, **fields)


def added_bos(tokenizer: Tokenizer) -> int | None:
  """The BOS id `tokenizer` puts before a text (transformers' `tokenizer(text)`), or None:
  `add_bos_token: true` in tokenizer_config.json, or, where it does not say, what the
  tokenizer.json's post-processor prepends (a single id). The byte tokenizer adds none."""
  if isinstance(tokenizer, ByteTokenizer):
    return None
  return _added_bos(tokenizer, read_tokenizer_config(tokenizer))


def _added_bos(tokenizer: Tokenizer, config: dict[str, Any]) -> int | None:
  bos_text = token_text(config.get('bos_token'))
  if config.get('add_bos_token') is True and bos_text:
    return getattr(tokenizer, 'token_id', lambda _: None)(bos_text)
  if 'add_bos_token' not in config and hasattr(tokenizer, 'added_prefix'):
    prefix = tokenizer.added_prefix()
    return prefix[0] if len(prefix) == 1 else None
  return None


def document_format(tokenizer: Tokenizer, *, eos_token: str = '', text_field: str = 'text',
                    prompt_field: str = 'prompt', completion_field: str = 'completion',
                    skip_bad_records: bool = False, text_documents: bool = False,
                    chat_template: str = '') -> DocumentFormat:
  """Resolves EOS, BOS and the chat template of `tokenizer` (see the module docstring);
  `chat_template`: a file whose template replaces the tokenizer's (data.chat_template).

  Raises:
    ConfigError: (naming `data.eos_token`) if no EOS can be found, or it is not one token.
  """
  fields = dict(text_field=text_field, prompt_field=prompt_field,
                completion_field=completion_field, skip_bad_records=skip_bad_records,
                text_documents=text_documents)
  chat_template = read_chat_template(chat_template) if chat_template else None
  if isinstance(tokenizer, ByteTokenizer):
    return _byte_format(eos_token, {**fields, 'chat_template': chat_template})
  config = read_tokenizer_config(tokenizer)
  token_id = getattr(tokenizer, 'token_id', lambda _: None)
  eos_text = eos_token or token_text(config.get('eos_token'))
  eos = token_id(eos_text) if eos_text else None
  if eos is None:
    where = (f'{eos_token!r} is not a token of data.tokenizer' if eos_token else
             f'no eos_token in a {_TOKENIZER_CONFIG} beside the tokenizer')
    raise ConfigError(f'data.eos_token: {where}; documents are separated by EOS. Set '
                      "data.eos_token to the tokenizer's end-of-text token (e.g. '</s>', "
                      "'<|endoftext|>').")
  bos_text = token_text(config.get('bos_token')) or ''
  bos = _added_bos(tokenizer, config)
  if chat_template is None:  # the tokenizer's own (not read where data.chat_template replaces it)
    path = getattr(tokenizer, 'path', None)
    chat_template = _chat_template(config, None if path is None else Path(path).parent)
  return DocumentFormat(eos=eos, bos=bos, chat_template=chat_template,
                        bos_text=bos_text, eos_text=eos_text, **fields)


# --- records -> parts ----------------------------------------------------------------------------

# A document as parts: (text, learned). Plain text is one learned part.
Parts = list[tuple[str, bool]]


def _string(record: dict, field: str, fmt: DocumentFormat) -> str:
  value = record[field]
  if not isinstance(value, str):
    raise BadRecord(f'field {field!r} is {type(value).__name__}, not a string')
  if fmt.refuse_nul and '\0' in value:
    raise BadRecord(f'field {field!r} holds a NUL character, which the byte tokenizer uses as '
                    'EOS')
  return value


def record_parts(record: Any, fmt: DocumentFormat) -> Parts:
  """The parts of one record (module docstring), read without its nulls (`without_nulls`), so
  that a JSON line and the Parquet or Arrow row of the same record read alike. Raises
  BadRecord."""
  if not isinstance(record, dict):
    raise BadRecord(f'a record must be a JSON object, got {type(record).__name__}')
  try:
    parts = _rule_parts(without_nulls(record), fmt)
  except RecursionError as e:  # a JSON line nested nearly as deep as Python parses
    raise BadRecord(f'nested too deep to read ({e})') from None
  if parts is not None:
    return parts
  nulls = [k for k in (fmt.prompt_field, fmt.completion_field, fmt.text_field, MESSAGES_FIELD,
                       SHAREGPT_FIELD, ALPACA_INSTRUCTION, *ALPACA_OUTPUT) if
           k in record and record[k] is None]
  if nulls:
    kind = 'a list' if nulls[0] in (MESSAGES_FIELD, SHAREGPT_FIELD) else 'a string'
    raise BadRecord(f'field {nulls[0]!r} is null, not {kind}')
  keys = ', '.join(repr(k) for k in list(record)[:8])
  raise BadRecord(f'record without the text field {fmt.text_field!r} (nor '
                  f'{fmt.prompt_field!r}+{fmt.completion_field!r}, {MESSAGES_FIELD!r}, '
                  f'{SHAREGPT_FIELD!r} or {ALPACA_INSTRUCTION!r}+{ALPACA_OUTPUT[0]!r}); its '
                  f'fields: {keys}; set data.text_field')


def _rule_parts(record: dict, fmt: DocumentFormat) -> Parts | None:
  """The parts of a record (without nulls) by the first rule that reads it, or None."""
  if fmt.prompt_field in record and fmt.completion_field in record:
    prompt, completion = record[fmt.prompt_field], record[fmt.completion_field]
    if isinstance(prompt, list) and isinstance(completion, list):  # conversational (TRL's)
      return chat_parts(_chat(prompt + completion, fmt, fmt.prompt_field), fmt,
                        learn_from=len(prompt), tools=_tools(record))
    return [(_string(record, fmt.prompt_field, fmt), False),
            (_string(record, fmt.completion_field, fmt), True)]
  if fmt.text_field in record:
    return [(_string(record, fmt.text_field, fmt), True)]
  if MESSAGES_FIELD in record:
    return chat_parts(_chat(record[MESSAGES_FIELD], fmt, MESSAGES_FIELD), fmt,
                      tools=_tools(record))
  if SHAREGPT_FIELD in record:
    return chat_parts(_chat(_sharegpt_messages(record[SHAREGPT_FIELD]), fmt, SHAREGPT_FIELD), fmt,
                      tools=_tools(record))
  output = next((field for field in ALPACA_OUTPUT if field in record), None)
  if ALPACA_INSTRUCTION in record and output is not None:
    return _alpaca_parts(record, output, fmt)
  return None


def without_nulls(value: Any) -> Any:
  """A record without its nulls, at any depth. Arrow gives every row every column, and every
  struct (a chat message) every field any row has, null where the record had none (a plain
  turn's tool_calls, an Alpaca row's input); pandas' and `datasets`' to_json write the same
  nulls into JSON lines (`{"text": null, "messages": [...]}` of a mixed dataset). Templates test
  `'tool_calls' in m`, and a null field is one the record does not have (a null text alone is
  then a record without a text: a bad record)."""
  if isinstance(value, dict):
    return {k: without_nulls(v) for k, v in value.items() if v is not None}
  if isinstance(value, list):
    return [without_nulls(v) for v in value]
  return value


def _alpaca_parts(record: dict, output: str, fmt: DocumentFormat) -> Parts:
  """An Alpaca record's parts (module docstring): as chat where the tokenizer has a template
  (an instruct model's fine-tune speaks its format), else Stanford Alpaca's prompt text."""
  response = _string(record, output, fmt)
  prompt = alpaca_prompt(record, fmt)
  if isinstance(prompt, list):
    return chat_parts(prompt + [{'role': 'assistant', 'content': response}], fmt)
  return [(prompt, False), (response, True)]


def alpaca_prompt(record: dict, fmt: DocumentFormat) -> str | list:
  """What an Alpaca record asks (module docstring), without its output: the system and user
  messages where the tokenizer has a chat template, else Stanford Alpaca's prompt text. Raises
  BadRecord."""
  instruction = _string(record, ALPACA_INSTRUCTION, fmt)
  extra = {field: record.get(field) or '' for field in (*ALPACA_INPUT, 'system')}
  for field, value in extra.items():
    if not isinstance(value, str):
      raise BadRecord(f'field {field!r} is {type(value).__name__}, not a string')
  context, system = extra['input'] or extra['context'], extra['system']
  if fmt.chat_template is not None:
    user = f'{instruction}\n\n{context}' if context else instruction
    messages = [{'role': 'system', 'content': system}] if system else []
    return messages + [{'role': 'user', 'content': user}]
  prompt = (ALPACA_PROMPT.format(instruction=instruction, input=context) if context else
            ALPACA_PROMPT_NO_INPUT.format(instruction=instruction))
  return f'{system}\n\n{prompt}' if system else prompt


def _chat(messages: Any, fmt: DocumentFormat, field: str) -> list:
  """`messages` (a record's `field`), checked to be a conversation the chat template renders."""
  if fmt.chat_template is None:
    raise BadRecord(f'record holds a conversation ({field!r}) but data.tokenizer has no chat '
                    f'template ({CHAT_TEMPLATE_FILE} or {_TOKENIZER_CONFIG}\'s chat_template); '
                    'set data.chat_template to a template file')
  if not (isinstance(messages, list) and messages and all(map(_is_message, messages))):
    raise BadRecord(f'{field!r} must be a non-empty list of {{"role": str, "content": str}} '
                    'objects (an assistant turn may hold "tool_calls", a list, instead of content)')
  return messages


def _is_message(message: Any) -> bool:
  """A chat message: a role and text content, or an assistant turn's tool calls (its content
  then None, absent or text)."""
  if not (isinstance(message, dict) and isinstance(message.get('role'), str)):
    return False
  if isinstance(message.get('tool_calls'), list):
    return message.get('content') is None or isinstance(message['content'], str)
  return isinstance(message.get('content'), str)


def _tools(record: dict) -> list | None:
  """A record's `tools` (the function schemas its conversation may call, as transformers'
  apply_chat_template takes them): a list, or a JSON string of one (Parquet often stores them
  so); None without."""
  tools = record.get(TOOLS_FIELD)
  if isinstance(tools, str):
    try:
      tools = fs.json_loads(tools)
    except json.JSONDecodeError as e:
      raise BadRecord(f'{TOOLS_FIELD!r} is a string but not JSON ({e})') from e
  if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict)
                                                                 for t in tools)):
    raise BadRecord(f'{TOOLS_FIELD!r} must be a list of JSON objects (function schemas)')
  return tools or None


# ShareGPT's speakers (a turn's 'from') as chat roles; function_call / observation are the
# tool-calling speakers of glaive-style data (LLaMA-Factory's): the call is an assistant turn (so
# it is learned), its result a tool turn.
SHAREGPT_ROLES = {'system': 'system', 'human': 'user', 'user': 'user', 'gpt': 'assistant',
                  'assistant': 'assistant', 'function_call': 'assistant', 'tool': 'tool',
                  'observation': 'tool'}


def _sharegpt_messages(turns: Any) -> list:
  """ShareGPT's `conversations` ([{"from": "human", "value": ...}, ...]) as chat messages."""
  if not (isinstance(turns, list) and all(
      isinstance(t, dict) and isinstance(t.get('from'), str) and isinstance(t.get('value'), str)
      for t in turns)):
    raise BadRecord(f'{SHAREGPT_FIELD!r} must be a list of {{"from": str, "value": str}} objects '
                    '(ShareGPT)')
  for i, turn in enumerate(turns):
    if turn['from'] not in SHAREGPT_ROLES:
      raise BadRecord(f'{SHAREGPT_FIELD!r} turn {i}: "from": {turn["from"]!r} is not one of '
                      f'{", ".join(SHAREGPT_ROLES)}')
  return [{'role': SHAREGPT_ROLES[t['from']], 'content': t['value']} for t in turns]


def _render(messages: list, fmt: DocumentFormat, generation_prompt: bool,
            tools: list | None = None, budget: int | None = None) -> str:
  """The rendered conversation, in the sandbox's budget of a record its size (chat_sandbox;
  `budget`: the whole record's, computed once for its renderings): anything the template
  refuses or fails on is a bad record."""
  if budget is None:
    budget = chat_sandbox.record_budget(messages, tools)
  try:
    return chat_sandbox.render(
        fmt.chat_template, budget, messages=messages, add_generation_prompt=generation_prompt,
        bos_token=fmt.bos_text, eos_token=fmt.eos_text, tools=tools)
  except chat_sandbox.TemplateRefused as e:
    raise BadRecord(str(e)) from e


def chat_parts(messages: list, fmt: DocumentFormat, learn_from: int = 0,
               tools: list | None = None) -> Parts:
  """The rendered conversation (with the `tools` it may call) cut into parts: each assistant
  turn from message `learn_from` on, as the whole conversation renders it (from the end of the
  rendering of the turns before it with the generation prompt, through the turn's end marker),
  is learned, the rest is not."""
  # Every rendering of a prefix within the whole record's budget (str() of it, once: ~7 us).
  render = functools.partial(_render, fmt=fmt, tools=tools,
                             budget=chat_sandbox.record_budget(messages, tools))
  full = render(messages, generation_prompt=False)
  parts, done = [], 0
  for i, message in enumerate(messages):
    if message['role'] != 'assistant' or i < learn_from:
      continue
    start = _turn_start(full, messages, i, render)
    end = _turn_end(full, messages, i, start, render, fmt.eos_text) if start >= done else -1
    if not done <= start <= end <= len(full):
      raise BadRecord('the chat template does not render conversations prefix by prefix, so '
                      'the assistant turns cannot be located: set data.chat_template to a '
                      'template that renders each turn alike whatever follows it')
    parts += [(full[done:start], False), (full[start:end], True)]
    done = end
  parts.append((full[done:], False))
  if fmt.refuse_nul and '\0' in full:
    raise BadRecord('the conversation holds a NUL character, which the byte tokenizer uses as EOS')
  return _without_template_eos([(text, learned) for text, learned in parts if text], fmt)


def drops_system_message(fmt: DocumentFormat) -> bool:
  """Whether `fmt`'s chat template leaves a system message out of a conversation it renders
  whole but writes it into a prompt (Mistral v0.3's writes it into the last user turn only, so
  never into a conversation that ends with a reply): such conversations are learned without
  it, as transformers' apply_chat_template renders them (prepare warns)."""
  if fmt.chat_template is None:
    return False
  system = {'role': 'system', 'content': '\ue000megatrain:system\ue000'}
  probe = [system, {'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello'}]
  try:
    whole = _render(probe, fmt, generation_prompt=False)
    prompt = _render(probe[:2], fmt, generation_prompt=True)
  except BadRecord:  # a template without a system role (it raises on one)
    return False
  return system['content'] in prompt and system['content'] not in whole


def _without_template_eos(parts: Parts, fmt: DocumentFormat) -> Parts:
  """`parts` of a rendered conversation without the EOS its template writes last (Mistral's
  ends the last reply with {{ eos_token }}): the document's own EOS (encode_documents) replaces
  it, so it is there once, as transformers' apply_chat_template gives it (twice before). The BOS
  a template writes first (Llama 3's and Mistral's begin with {{ bos_token }}) stays, tokenized
  with what follows it as transformers tokenizes the rendering, and is the document's
  (encode_documents adds none where the ids begin with it).

  Where the EOS is the template's turn end (Qwen2.5 Instruct's '<|im_end|>', every turn ended
  '<|im_end|>\n'), the document ends at the last turn's: the whitespace after it goes too, so
  the reply is learned as generation writes it, ending at the EOS that stops it (not
  '<|im_end|>\n<|im_end|>')."""
  last = parts[-1][0] if parts else ''
  if fmt.eos_text and not last.endswith(fmt.eos_text) and last.rstrip().endswith(fmt.eos_text):
    last = last.rstrip()
  if fmt.eos_text and last.endswith(fmt.eos_text):
    parts[-1] = (last[:-len(fmt.eos_text)], parts[-1][1])
  return [(text, learned) for text, learned in parts if text]


def _adds_bos(ids: Sequence[int], fmt: DocumentFormat) -> bool:
  """Whether the tokenizer's BOS goes before `ids` of a document or prompt: where it adds one,
  unless they begin with it (a rendering whose template writes {{ bos_token }} first, tokenized
  whole: a Metaspace tokenizer gives the text after a BOS no '▁' of its own, as transformers
  does; the rendering without its BOS, tokenized alone, got one)."""
  return fmt.bos is not None and not (len(ids) and ids[0] == fmt.bos)


def _turn_start(full: str, messages: list, i: int, render) -> int:
  """Where assistant turn `i` starts in `full`, the whole conversation's rendering: the end of
  the conversation before it rendered with the generation prompt. Usually that rendering is a
  prefix of `full`; but a template may render the turns before a reply otherwise once later
  ones follow (Mistral v0.3's writes the system message into the last user turn only), and then
  the turn starts where the message before it ends in `full` (found by a mark after its
  content), after what the generation prompt writes after that message ('[/INST]'): the reply
  is learned in the context `full` gives it, the tokens transformers' apply_chat_template gives
  the conversation. -1 where neither locates it (chat_parts refuses the record)."""
  prompt = render(messages[:i], generation_prompt=True)
  if full.startswith(prompt):
    return len(prompt)
  if i == 0:
    return -1
  marked = _with_mark(messages, i - 1)
  if marked is None:
    return -1
  whole = render(marked + list(messages[i:]), generation_prompt=False)
  cut = render(marked, generation_prompt=True)
  if whole.count(_CONTENT_END) != 1 or whole.replace(_CONTENT_END, '') != full:
    return -1
  at = whole.index(_CONTENT_END)  # in `full` too: the mark is the only difference
  opener = cut[cut.rfind(_CONTENT_END) + len(_CONTENT_END):]  # what opens the reply
  return at + len(opener) if _CONTENT_END in cut and full.startswith(opener, at) else -1


def _with_mark(messages: list, i: int) -> list | None:
  """`messages` up to and with message `i`, its content ended with _CONTENT_END; None where it
  has no text content (tool calls)."""
  content = messages[i].get('content')
  if not isinstance(content, str):
    return None
  return [*messages[:i], {**messages[i], 'content': content + _CONTENT_END}]


def _turn_end(full: str, messages: list, i: int, start: int, render, eos_text: str) -> int:
  """Where assistant turn `i` (with its end marker) ends in `full`, the whole conversation's
  rendering. Usually the length of the conversation rendered up to that turn; but a template may
  render the last turn otherwise (Qwen3 opens an assistant turn after the last user message with
  a thinking block), and then the turn's content is found in `full` after `start` (the end of
  the generation prompt), followed by the end marker the template writes after it (Qwen3's
  '<|im_end|>' and a newline); or it may rewrite the content of a turn a user turn follows
  (Qwen3 drops its '<think>...</think>'), and then where the content ends is marked
  (`_marked_turn_end`)."""
  upto = render(messages[:i + 1], generation_prompt=False)
  if full.startswith(upto):
    return len(upto)
  if eos_text and upto.endswith(eos_text) and full.startswith(upto[:-len(eos_text)]):
    # The template ends only a whole conversation with the EOS (Phi-3's '{{ eos_token }}' where
    # no generation prompt follows): a turn that others follow ends before it.
    return len(upto) - len(eos_text)
  content = messages[i].get('content') or ''
  in_upto = upto.rfind(content) if content else -1
  at = full.find(content, start) if content else -1
  if in_upto >= 0 and at >= 0:
    marker = upto[in_upto + len(content):]  # what the template writes after the content
    if full.startswith(marker, at + len(content)):
      return at + len(content) + len(marker)
  end = _marked_turn_end(full, messages, i, start, render)
  if end is None:
    raise BadRecord('the chat template renders an assistant turn so differently once later '
                    'turns follow it that the turn cannot be located in the conversation')
  return end


# Appended to an assistant turn's content to find where the template writes its end (private-use
# characters: no template changes or writes them).
_CONTENT_END = '\ue000megatrain:content-end\ue000'


def _marked_turn_end(full: str, messages: list, i: int, start: int, render) -> int | None:
  """Where assistant turn `i` ends in `full`, found by rendering the conversation with a mark
  after the turn's content: where the mark lands in the whole rendering is where the content,
  as the template rewrites it there, ends (Qwen3's answer without its thinking), and the turn
  ends after the end marker the template writes after the content when the turn is the last.
  None where the mark changes the rendering otherwise (a template that trims the content) or
  the turn has no text content (tool calls)."""
  marked = _with_mark(messages, i)
  if marked is None:
    return None
  whole = render(marked + list(messages[i + 1:]), generation_prompt=False)
  last = render(marked, generation_prompt=False)
  if (whole.count(_CONTENT_END) != 1 or whole.replace(_CONTENT_END, '') != full or
      _CONTENT_END not in last):
    return None
  at = whole.index(_CONTENT_END)  # in `full` too: the mark is the only difference
  marker = last[last.rindex(_CONTENT_END) + len(_CONTENT_END):]  # the turn's end, as the last
  if at < start or not full.startswith(marker, at):
    return None
  return at + len(marker)


def prompt_ids(prompt: str | list | dict, tokenizer: Tokenizer, fmt: DocumentFormat,
               chat: bool = False, system: str = '') -> list:
  """The token ids a document starting with `prompt` begins with in training ([BOS] text); with
  `chat`, a user turn of `prompt` (after a `system` turn, if given) rendered by the chat template
  up to the assistant's reply; a list of chat messages (a sample.prompts record's) rendered whole
  up to the assistant's next turn; an Alpaca record (a dict) as training renders it up to its
  output (`alpaca_prompt`). What `--sample` continues.

  Raises:
    ConfigError: (naming `sample.chat` or `sample.prompts`) a chat prompt without a chat
      template, or messages that are not a conversation the template renders.
  """
  if isinstance(prompt, dict):  # an Alpaca record: its prompt text, or its messages
    try:
      prompt = alpaca_prompt(prompt, fmt)
    except BadRecord as e:
      raise ConfigError(f'sample.prompts: an Alpaca record: {e}.') from e
  if isinstance(prompt, list):
    try:
      text = _render(_chat(prompt, fmt, 'messages'), fmt, generation_prompt=True)
    except BadRecord as e:
      raise ConfigError(f'sample.prompts: a prompt of chat messages: {e}.') from e
  elif chat:
    if not fmt.chat_template:
      raise ConfigError('sample.chat: data.tokenizer has no chat template (tokenizer_config.json '
                        "'chat_template'); set data.chat_template to a template file (jinja2), "
                        'or sample.chat=False to continue the plain text.')
    messages = [{'role': 'system', 'content': system}] if system else []
    text = _render(messages + [{'role': 'user', 'content': prompt}], fmt, generation_prompt=True)
  else:
    text = prompt
  ids = list(encode_batch(tokenizer, [text])[0])
  return [fmt.bos] + ids if _adds_bos(ids, fmt) else ids


# --- parts -> tokens ---------------------------------------------------------------------------


def encode_documents(documents: Sequence[Parts], tokenizer: Tokenizer, fmt: DocumentFormat,
                     dtype: np.dtype) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
  """Tokens of the documents, each as [BOS] parts EOS, their loss mask (None when every token
  is learned, as for plain text) and where each document ends ([n] int64 offsets just past its
  EOS): the documents as they were, whatever ids they hold (a chat template may end every turn
  with the EOS). A document of several parts is tokenized whole, as transformers tokenizes a
  rendered conversation or a prompt with its completion, and a token is learned where it holds
  learned text (`_joint_ids`); tokenized part by part, the joins got tokens of their own (a
  SentencePiece '▁' before each part, 'Ġ' + 'Paris' for ' Paris')."""
  encoded = _document_ids(documents, tokenizer)
  flat: list[int] = []
  done: list[np.ndarray] = []  # the tokens before `flat`, where a long document's array cut it
  before = 0  # how many tokens `done` holds
  ends: list[int] = []
  masks = []
  for ids, learned in encoded:
    bos = _adds_bos(ids, fmt)  # a template's own BOS first is the document's
    if bos:
      flat.append(fmt.bos)
    if isinstance(ids, np.ndarray):  # a long document's: kept an array (a list is ~10x)
      done += [np.array(flat, dtype=dtype), ids.astype(dtype)]
      before, flat = before + len(flat) + len(ids), []
    else:
      flat.extend(ids)
    flat.append(fmt.eos)
    ends.append(before + len(flat))
    masks.append((int(bos), len(ids), learned))
  tokens = np.concatenate([*done, np.array(flat, dtype=dtype)]) if done else np.array(flat, dtype)
  ends = np.array(ends, dtype=np.int64)
  if all(learned is None for _, _, learned in masks):
    return tokens, None, ends
  mask = np.concatenate([np.concatenate([np.zeros(bos, np.uint8),
                                         np.ones(n, np.uint8) if learned is None else learned,
                                         np.ones(1, np.uint8)]) for bos, n, learned in masks])
  return tokens, (None if mask.all() else mask), ends


def _document_ids(documents: Sequence[Parts],
                  tokenizer: Tokenizer) -> list[tuple[Sequence[int], np.ndarray | None]]:
  """(ids, learned: uint8 per id, None = all) of each document: a document of one part (text)
  or any document of a tokenizer without offsets (the byte tokenizer: its ids are the bytes,
  the same whole or in parts) part by part; one of several parts whole (`_joint_ids`). A long
  part (tokenizer.is_long) is encoded in pieces (a 256 MB text whole took ~50 GB), its ids an
  array."""
  joint = [i for i, parts in enumerate(documents)
           if len(parts) > 1 and hasattr(tokenizer, 'encodings')]
  alone = sorted(set(range(len(documents))) - set(joint))
  out: list = [None] * len(documents)
  short = iter(encode_batch(tokenizer, [text for i in alone for text, _ in documents[i]
                                        if not is_long(text)]))
  for i in alone:
    pieces = [(encode_text(tokenizer, text) if is_long(text) else next(short), learned)
              for text, learned in documents[i]]
    ids = _joined([piece for piece, _ in pieces])
    if all(learned for _, learned in pieces):  # text: as the tokenizer gave it, all learned
      out[i] = (ids, None)
      continue
    out[i] = (ids, np.repeat(np.array([int(l) for _, l in pieces], np.uint8),
                             [len(piece) for piece, _ in pieces]))
  if joint:
    for i, encoded in zip(joint, _joint_ids([documents[i] for i in joint], tokenizer)):
      out[i] = encoded
  return out


def _joined(pieces: list) -> Sequence[int]:
  """The ids of a document's parts, one after another: an array where one is (a long part's),
  else as the tokenizer gave them (one part) or a list."""
  if any(isinstance(piece, np.ndarray) for piece in pieces):
    return np.concatenate([ids_array(piece) for piece in pieces])
  return pieces[0] if len(pieces) == 1 else [t for piece in pieces for t in piece]


def _joint_ids(documents: Sequence[Parts], tokenizer) -> list[tuple[Sequence[int], np.ndarray]]:
  """Each document's parts joined and tokenized whole (a long one in the pieces
  tokenizer.text_cuts gives, whose ids are those of the whole); the tokens that hold characters
  of a learned part are learned (a token across the join, 'ĠParis' of 'Answer: ' + 'Paris', is
  the completion's)."""
  texts = [''.join(text for text, _ in parts) for parts in documents]
  short = iter(tokenizer.encodings([text for text in texts if not is_long(text)]))
  out = []
  for parts, text in zip(documents, texts):
    if not is_long(text):
      encoding = next(short)
      out.append((encoding.ids, _learned_tokens(encoding, parts, 0, len(text))))
      continue
    bounds, ids, learned = [*text_cuts(tokenizer, text), len(text)], [], []
    for start, end in zip(bounds, bounds[1:]):  # one piece's Encoding at a time (~80 B a token)
      encoding = tokenizer.encodings([text[start:end]])[0]
      ids.append(ids_array(encoding.ids))
      learned.append(_learned_tokens(encoding, parts, start, end))
    out.append((np.concatenate(ids), np.concatenate(learned)))
  return out


def _learned_tokens(encoding, parts: Parts, start: int, end: int) -> np.ndarray:
  """Which tokens of `encoding` (of the parts' joined text[start:end]) hold characters of a
  learned part, found from each part's first and last characters there
  (Encoding.char_to_token: a few lookups a part, not every token's offsets, which took ~85 us a
  document)."""
  learned = np.zeros(len(encoding.ids), np.uint8)
  at = 0
  for text, is_learned in parts:
    lo, hi = max(at, start) - start, min(at + len(text), end) - start
    if is_learned and lo < hi:
      first = _token_of(encoding, range(lo, hi))
      last = _last_token_of(encoding, lo, hi)
      if first is not None and last is not None:
        learned[first:last + 1] = 1
    at += len(text)
  return learned


def _last_token_of(encoding, start: int, end: int) -> int | None:
  """The last token holding a character of text[start:end]. char_to_token names a character's
  first token only, and a byte-level BPE may split one character into several (an emoji's 4
  bytes, a rare CJK character's 3): the tokens after it that begin before `end` hold it too."""
  last = _token_of(encoding, range(end - 1, start - 1, -1))
  while last is not None and last + 1 < len(encoding.ids):
    chars = encoding.token_to_chars(last + 1)
    if chars is None or chars[0] >= end:
      break
    last += 1
  return last


def _token_of(encoding, chars: range) -> int | None:
  """The token holding the first of `chars` that one holds (a normalizer may drop characters)."""
  for char in chars:
    token = encoding.char_to_token(char)
    if token is not None:
      return token
  return None


def check_ids(tokens: np.ndarray, tokenizer: Tokenizer) -> None:
  """Out-of-range ids would wrap silently in the narrow stored dtype."""
  if tokens.size and (tokens.min() < 0 or tokens.max() >= tokenizer.vocab_size):
    raise ValueError(f'tokenizer {tokenizer.name!r} returned ids in [{tokens.min()}, '
                     f'{tokens.max()}], outside its vocab_size {tokenizer.vocab_size}')
