"""What the chat-template sandbox's budget costs: µs per rendering of a conversation with
data/chat_sandbox.render (every value sized against the record's budget) and with jinja2's plain
immutable sandbox (the same template, no sizing), side by side in one process.

  python bench/chat_render.py                 # Llama-3.1-style and ChatML templates, ~10 s

A prepare renders each conversation 1 + 2 x (assistant turns) times (data/documents.chat_parts),
each within the record's budget, computed once (a str() of the record: ~7 us).
"""

import argparse
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatrain_jax.data import chat_sandbox  # pylint: disable=wrong-import-position

TEMPLATES = {
    # Llama 3.1 Instruct's, without its tool branches.
    'llama3': (
        "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}"
        "{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}"
        "{%- else %}{%- set system_message = '' %}{%- endif %}"
        "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
        "{{- 'Cutting Knowledge Date: December 2023\\n' }}{{- 'Today Date: 26 Jul 2024\\n\\n' }}"
        "{{- system_message }}{{- '<|eot_id|>' }}{%- for message in messages %}"
        "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
        "message['content'] | trim + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}"
        "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"),
    # Qwen2.5's ChatML, without its tool branches.
    'chatml': (
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
        "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--renders', type=int, default=2000)
  parser.add_argument('--rounds', type=int, default=3)
  args = parser.parse_args()
  from jinja2 import ext, sandbox  # pylint: disable=g-import-not-at-top
  plain = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[ext.loopcontrols])
  conversation = [{'role': 'system', 'content': 'You are helpful.'}] + [
      {'role': role, 'content': ('word ' * 60).strip()} for role in ['user', 'assistant'] * 4]
  variables = dict(messages=conversation, add_generation_prompt=False, bos_token='<s>',
                   eos_token='</s>', tools=None)
  print('| template | jinja2 sandbox (us) | chat_sandbox (us) | ratio |\n|---|---:|---:|---:|')
  for name, template in TEMPLATES.items():
    compiled = plain.from_string(template)
    budget = chat_sandbox.record_budget(conversation, None)  # once a record, as chat_parts
    runs = {'plain': lambda: compiled.render(**variables),
            'sized': lambda: chat_sandbox.render(template, budget, **variables)}
    assert runs['plain']() == runs['sized']()
    best = {}
    for _ in range(args.rounds):  # alternated: a noisy machine weighs on both alike
      for label, run in runs.items():
        started = time.perf_counter()
        for _ in range(args.renders):
          run()
        seconds = (time.perf_counter() - started) / args.renders
        best[label] = min(best.get(label, seconds), seconds)
    print(f'| {name} | {best["plain"] * 1e6:.1f} | {best["sized"] * 1e6:.1f} | '
          f'{best["sized"] / best["plain"]:.2f} |')


if __name__ == '__main__':
  main()
