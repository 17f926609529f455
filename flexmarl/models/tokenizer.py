"""Tokenizers in the HF `tokenizers` format.

The built-in tasks use a character-level tokenizer that the package builds itself
(no download); any HF tokenizer folder or `tokenizer.json` works for real models,
its special tokens read from `tokenizer_config.json` (and extra stop ids from
`generation_config.json`) when the folder has them.

Train as you serve: a prompt is encoded by the tokenizer's own call (its
post-processor adds BOS where the model expects it), so transformers and vLLM,
given the saved folder, encode it exactly as training did; `stop_ids` end an
answer and `banned_ids` (every other special token) are never sampled.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import string
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from flexmarl.core.errors import CheckpointFileError, ConfigError

PAD, BOS, EOS = '<pad>', '<bos>', '<eos>'
CHAT_ROLES = ('system', 'user', 'assistant', 'tool')
# A prompt: raw text, or chat messages ({'role': ..., 'content': ...}) that the agent's
# chat template renders. An assistant message's content may be a sampled turn (a
# `Completion` generate() returned: `.text` and `.tokens`), which goes into the prompt as
# the exact tokens sampled, not its text encoded again.
Prompt = str | Sequence[Mapping[str, Any]]
# Stands for a sampled turn's content while the template renders (no template or text
# writes it); the rendered text is cut there and the turn's tokens spliced in.
_TURN = '\x00flexmarl-turn-{}\x00'
# Characters the built-in tasks use; kept in a fixed order so ids never move.
DEFAULT_CHARS = string.digits + string.ascii_lowercase + ' +-*=?:>|<,.'


class TextTokenizer:
  """Thin wrapper over an HF `Tokenizer` with the ids the sampler and trainer need.

  `bos` may be None (Qwen2 has none): prompts then start with their first token;
  `pad` defaults to `eos`, as in most HF causal LMs.
  """

  def __init__(self, tokenizer: Tokenizer, *, eos: str = EOS, bos: str | None = BOS,
               pad: str | None = PAD, alphabet: str | None = None,
               hf_config: dict | None = None, extra_stop_ids: tuple[int, ...] = (),
               source: str = ''):
    """`alphabet`: the only characters `encode` accepts (the char tokenizer's), or None.
    `hf_config`: the rest of the folder's tokenizer_config.json (chat template, added
    tokens...), written back by `save` so an exported model keeps it.
    `extra_stop_ids`: further ids that end an answer (a model's generation_config
    may list several EOS ids). `source`: what it was loaded from ('char', a folder, a
    GGUF checkpoint), named in its errors so the user knows which setting to change."""
    self.hf = tokenizer
    self.alphabet, self.source = alphabet, source
    self.hf_config = dict(hf_config or {})
    vocab = tokenizer.get_vocab()
    for role, special in (('eos', eos), ('bos', bos), ('pad', pad)):
      if special is not None and special not in vocab:
        raise ValueError(f'tokenizer has no {role} token {special!r}; name it in '
                         f'tokenizer_config.json ("{role}_token") or add it to the vocabulary.')
    self.specials = {'eos_token': eos, 'bos_token': bos, 'pad_token': pad}
    self.eos_id = vocab[eos]
    self.bos_id = vocab[bos] if bos is not None else None
    self.pad_id = vocab[pad] if pad is not None else self.eos_id
    self.vocab_size = tokenizer.get_vocab_size()
    self.stop_ids = tuple(dict.fromkeys((self.eos_id, *extra_stop_ids)))
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    special |= {i for i in (self.bos_id, self.pad_id) if i is not None}
    self.banned_ids = tuple(sorted(special - set(self.stop_ids)))

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`, as the tokenizer's own call gives them (with the special
    tokens its post-processor adds, e.g. BOS in front)."""
    if self.alphabet is not None:
      unknown = next((c for c in text if c not in self.alphabet), None)
      if unknown is not None:
        raise ValueError(f'character {unknown!r} of {text!r} is not in the char tokenizer\'s '
                         f'alphabet {self.alphabet!r}; write prompts with those characters '
                         '(e.g. lower-case them), or use an HF tokenizer (config.tokenizer).')
    return self.hf.encode(text).ids

  def __getstate__(self) -> dict:
    """For pickling (Ray ships tokenizers to its workers): without the compiled chat
    template, which does not pickle; it is compiled again on first use."""
    state = dict(self.__dict__)
    state.pop('_template', None)
    return state

  @property
  def chat_template(self) -> str | None:
    return self.hf_config.get('chat_template')

  @functools.cached_property
  def _template(self):
    """The chat template compiled as transformers compiles it (a sandboxed Jinja
    environment, trim_blocks and lstrip_blocks, its `tojson`, `raise_exception` and
    `strftime_now`), so it renders the same text."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
      raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=['jinja2.ext.loopcontrols'])
    env.filters['tojson'] = lambda x, ensure_ascii=False, indent=None, separators=None, \
        sort_keys=False: json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                                    separators=separators, sort_keys=sort_keys)
    env.globals['raise_exception'] = raise_exception
    env.globals['strftime_now'] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(self.chat_template)

  def render_chat(self, messages: Sequence[Mapping[str, str]],
                  add_generation_prompt: bool = True) -> str:
    """The text of `messages` in the model's chat format, ending (by default) with the
    header of the assistant's turn that the model is to write."""
    if not self.chat_template:
      name = f'tokenizer {self.source!r}' if self.source else 'this tokenizer'
      raise ValueError(f'{name} has no chat template (tokenizer_config.json '
                       '"chat_template") to render chat messages with; '
                       "set config.tokenizer (or the agent's agents.NAME.tokenizer) to an "
                       "instruct model's tokenizer (its HF folder or GGUF file carries one), "
                       'or pass the prompt as a string.')
    check_messages(messages)
    specials = {k: v for k, v in self.specials.items() if v is not None}
    return self._template.render(messages=[dict(m) for m in messages], tools=None,
                                 documents=None, add_generation_prompt=add_generation_prompt,
                                 **specials)

  def encode_prompt(self, prompt: Prompt) -> list[int]:
    """Ids of a prompt: a string by the tokenizer's own call (`encode`); chat messages
    rendered by the chat template and encoded without added special tokens (the template
    writes them), exactly as transformers' `apply_chat_template` encodes them."""
    if isinstance(prompt, str):
      return self.encode(prompt)
    check_messages(prompt)
    turns = [m['content'] for m in prompt if is_sampled_turn(m['content'])]
    if not turns:
      return self.hf.encode(self.render_chat(prompt), add_special_tokens=False).ids
    return self._splice(prompt, turns)

  def _splice(self, messages: Sequence[Mapping[str, Any]], turns: list) -> list[int]:
    """Ids of messages holding sampled turns: the template's text around each turn
    encoded, the turn's own tokens in between. A turn that ended at a stop token has it
    already; the template's own end-of-turn token after it is then not repeated."""
    k = iter(range(len(turns)))
    rendered = self.render_chat([dict(m, content=_TURN.format(next(k)))
                                 if is_sampled_turn(m['content']) else m for m in messages])
    ids: list[int] = []
    for i, turn in enumerate(turns):
      before, marker, rendered = rendered.partition(_TURN.format(i))
      if not marker or _TURN.format(i) in rendered:
        raise ValueError('the chat template changes or repeats an assistant message\'s '
                         'content, so a sampled turn\'s exact tokens cannot be placed; pass '
                         'its text (turn.text) instead.')
      ids += self.hf.encode(before, add_special_tokens=False).ids
      tokens = [int(t) for t in turn.tokens]
      ids += tokens
      end = self.hf.id_to_token(tokens[-1]) if tokens and tokens[-1] in self.stop_ids else None
      if end and rendered.startswith(end):
        rendered = rendered[len(end):]
    return ids + self.hf.encode(rendered, add_special_tokens=False).ids

  def decode(self, ids) -> str:
    """Text of response ids up to the first stop id. Every other token is shown,
    special ones included: a token the reward never sees is one the policy never
    learns to avoid."""
    out = []
    for i in ids:
      i = int(i)
      if i in self.stop_ids:
        break
      out.append(i)
    return self.hf.decode(out, skip_special_tokens=False)

  def save(self, folder: str) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, 'tokenizer.json')
    self.hf.save(path)
    # tokenizer_class lets transformers' AutoTokenizer (and vLLM) load the folder.
    config = {'tokenizer_class': 'PreTrainedTokenizerFast', **self.hf_config, **self.specials}
    with open(os.path.join(folder, 'tokenizer_config.json'), 'w', encoding='utf-8') as f:
      json.dump(config, f, indent=2)
    return path


def check_messages(messages) -> None:
  """Raises unless `messages` is a non-empty list of {'role', 'content'} chat messages."""
  example = "[{'role': 'user', 'content': 'What is 2 + 3?'}]"
  if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence) \
      or not messages:
    raise ValueError(f'prompt={messages!r}: give a string, or a non-empty list of chat '
                     f'messages, e.g. {example}.')
  for i, m in enumerate(messages):
    if not isinstance(m, Mapping) or set(m) - {'role', 'content'} or 'role' not in m:
      raise ValueError(f'prompt message {i} ({m!r}): give a dict with "role" and "content", '
                       f'e.g. {example}.')
    if m['role'] not in CHAT_ROLES:
      raise ValueError(f'prompt message {i}: role {m["role"]!r} is not one of {CHAT_ROLES}.')
    content = m.get('content')
    if is_sampled_turn(content) and m['role'] != 'assistant':
      raise ValueError(f'prompt message {i}: a sampled turn (a Completion) is the content of '
                       f'an assistant message, not of a {m["role"]!r} one.')
    if not isinstance(content, str) and not is_sampled_turn(content):
      raise ValueError(f'prompt message {i}: content {content!r} is not a string (or, for '
                       'an assistant, a Completion generate() returned).')


def is_sampled_turn(content: Any) -> bool:
  """A Completion as message content: its text and the exact tokens sampled."""
  return hasattr(content, 'text') and hasattr(content, 'tokens') and not isinstance(content, str)


def build_char_tokenizer(chars: str = DEFAULT_CHARS) -> TextTokenizer:
  """A character-level tokenizer: one token per character, specials first."""
  vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, *chars])}
  tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
  tok.pre_tokenizer = pre_tokenizers.Split(pattern='', behavior='isolated')
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens([PAD, BOS, EOS])
  # BOS in front of every encoding, by the tokenizer itself: saved with it, so HF and
  # vLLM encode a prompt exactly as training does.
  _add_bos(tok, BOS)
  return TextTokenizer(tok, alphabet=chars, source='char')


def per_agent(tokenizers: 'TextTokenizer | Mapping[str, TextTokenizer]',
              agents: Iterable[str]) -> dict[str, 'TextTokenizer']:
  """Each agent's tokenizer: one shared by the team, or one per agent."""
  if isinstance(tokenizers, TextTokenizer):
    return dict.fromkeys(agents, tokenizers)
  return {name: tokenizers[name] for name in agents}


def _special(value) -> str | None:
  """tokenizer_config.json holds a special token as a string or {"content": ...}."""
  return value.get('content') if isinstance(value, dict) else value


def load_tokenizer(path: str) -> TextTokenizer:
  """`path`: 'char' for the built-in one, a tokenizer.json, an HF tokenizer folder, or a
  GGUF checkpoint (a .gguf file, `package:NAME`) whose own tokenizer and chat template it
  carries."""
  if path == 'char':
    return build_char_tokenizer()
  from flexmarl.models import gguf, source
  try:
    if source.kind(path) == source.GGUF:
      tokenizer, cfg = gguf.tokenizer_parts(path)
      return TextTokenizer(tokenizer, eos=cfg['eos_token'], bos=cfg.get('bos_token'),
                           pad=cfg.get('pad_token'), hf_config=cfg, source=path)
    local = source.local(path)  # a hub id: its cached folder
  except CheckpointFileError as e:  # it names the file; the message names the field
    raise ConfigError(f'config.tokenizer={path!r}: {e.problem}') from None
  folder, file = ((local, os.path.join(local, 'tokenizer.json')) if os.path.isdir(local)
                  else (os.path.dirname(local), local))
  if not os.path.exists(file):
    raise FileNotFoundError(
        f'config.tokenizer={path!r}: no tokenizer.json there; give "char" for the built-in '
        'character tokenizer, or an HF tokenizer folder / tokenizer.json.')
  specials = {'eos': EOS, 'bos': BOS, 'pad': PAD}
  cfg, stops = {}, ()
  generation_file = os.path.join(folder, 'generation_config.json')
  if os.path.exists(generation_file):
    with open(generation_file, encoding='utf-8') as f:
      eos = json.load(f).get('eos_token_id')
    stops = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
  config_file = os.path.join(folder, 'tokenizer_config.json')
  if os.path.exists(config_file):
    with open(config_file, encoding='utf-8') as f:
      cfg = json.load(f)
    specials = {role: _special(cfg.get(f'{role}_token')) for role in specials}
    if specials['eos'] is None:
      raise ValueError(f'{config_file} names no eos_token; generation needs one to stop.')
  tokenizer = Tokenizer.from_file(file)
  if cfg.get('add_bos_token') and specials['bos'] is not None:
    _add_bos(tokenizer, specials['bos'])  # what transformers does with add_bos_token
  return TextTokenizer(tokenizer, **specials, hf_config=cfg, extra_stop_ids=stops,
                       source=path)


def _add_bos(tokenizer: Tokenizer, bos: str) -> None:
  """Make the tokenizer's own call put `bos` in front, unless it already does."""
  bos_id = tokenizer.token_to_id(bos)
  if bos_id is not None and tokenizer.encode('').ids[:1] != [bos_id]:
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f'{bos} $A', pair=f'{bos} $A $B', special_tokens=[(bos, bos_id)])
