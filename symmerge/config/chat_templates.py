"""The chat templates a mergekit config names (``chat_template: chatml``): the names mergekit 0.1.5 ships
(alpaca, chatml, exaone, llama3, mistral), each written here from its format's public description:

* ``chatml``: OpenAI's ChatML — ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`` per message;
* ``llama3``: Meta's Llama 3 prompt format — the BOS token, then ``<|start_header_id|>ROLE<|end_header_id|>\\n\\n
  CONTENT<|eot_id|>`` per message (content trimmed);
* ``mistral``: Mistral's instruction format — ``[INST] USER [/INST]`` and the assistant's reply closed by EOS
  (a system message is put before the first user turn);
* ``alpaca``: Stanford Alpaca's ``### Instruction:`` / ``### Response:`` blocks;
* ``exaone``: LG EXAONE's ``[|system|]`` / ``[|user|]`` / ``[|assistant|]`` turns closed by ``[|endofturn|]``.

Each ends with the assistant's opening when ``add_generation_prompt`` is set. ``tests/config/test_published_configs.py``
renders them beside mergekit's own on the same conversations.
"""

from __future__ import annotations

def _gen(opening: str) -> str:
    return "{% if add_generation_prompt %}{{ '" + opening + "' }}{% endif %}"

CHATML = ("{% for message in messages %}"
          "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
          "{% endfor %}" + _gen("<|im_start|>assistant\\n"))

LLAMA3 = ("{{ bos_token }}{% for message in messages %}"
          "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
          " + '<|eot_id|>' }}{% endfor %}" + _gen("<|start_header_id|>assistant<|end_header_id|>\\n\\n"))

MISTRAL = ("{{ bos_token }}{% set system = namespace(text='') %}"
           "{% for message in messages %}"
           "{% if message['role'] == 'system' %}{% set system.text = message['content'] + '\\n\\n' %}"
           "{% elif message['role'] == 'user' %}{{ '[INST] ' + system.text + message['content'] + ' [/INST]' }}"
           "{% set system.text = '' %}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
           "{% endif %}{% endfor %}")

ALPACA = ("{% for message in messages %}"
          "{% if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}"
          "{% elif message['role'] == 'user' %}{{ '### Instruction:\\n' + message['content'] + '\\n\\n' }}"
          "{% elif message['role'] == 'assistant' %}"
          "{{ '### Response:\\n' + message['content'] + eos_token + '\\n\\n' }}"
          "{% endif %}{% endfor %}" + _gen("### Response:\\n"))

EXAONE = ("{% for message in messages %}"
          "{% if message['role'] == 'system' %}{{ '[|system|]' + message['content'] + '[|endofturn|]\\n' }}"
          "{% elif message['role'] == 'user' %}{{ '[|user|]' + message['content'] + '\\n' }}"
          "{% elif message['role'] == 'assistant' %}{{ '[|assistant|]' + message['content'] + '[|endofturn|]\\n' }}"
          "{% endif %}{% endfor %}" + _gen("[|assistant|]"))

TEMPLATES = {"alpaca": ALPACA, "chatml": CHATML, "exaone": EXAONE, "llama3": LLAMA3, "mistral": MISTRAL}


def named(name: str) -> str | None:
    """The template of a built-in name (None: not one)."""
    return TEMPLATES.get(name.strip())
