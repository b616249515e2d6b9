"""Chat templates in the tool-call formats of hf_tpu/serving/_tools.py, written for the tests (the shipped tiny model's
template renders no tools; the Hermes one renders only the tools' names, so that a prompt with tools fits the tiny
model's 256 positions), and the shipped model with one of them."""

from __future__ import annotations

import shutil

from hf_tpu.assets import default_model_path

HERMES_TEMPLATE = """
{%- if tools -%}
system: call {% for tool in tools %}{{ tool['function']['name'] }} {% endfor -%}
as <tool_call>{"name": NAME, "arguments": ARGUMENTS}</tool_call>
{% endif -%}
{%- for message in messages -%}
{{ message['role'] }}: {{ message['content'] or '' }}
{%- for call in message.get('tool_calls') or [] %}
<tool_call>
{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}
</tool_call>
{%- endfor %}{{ '\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
assistant:
{%- endif -%}
""".strip()

LLAMA3_TEMPLATE = """
{%- if tools -%}
<|start_header_id|>system<|end_header_id|>

Answer with a call as {"name": function name, "parameters": dictionary of argument name and its value}.
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}<|eot_id|>
{%- endif -%}
{%- for message in messages -%}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{% if message.get('tool_calls') -%}
<|python_tag|>
{%- for call in message['tool_calls'] -%}
{{ {'name': call['function']['name'], 'parameters': call['function']['arguments']} | tojson }}
{%- if not loop.last %}; {% endif -%}
{%- endfor -%}
{%- else -%}
{{ message['content'] }}
{%- endif -%}
<|eot_id|>
{%- endfor -%}
{%- if add_generation_prompt -%}
<|start_header_id|>assistant<|end_header_id|>

{% endif -%}
""".strip()

TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def model_dir(tmp_path, template: str):
    """The shipped tiny model with ``template`` as its chat template (a copy in ``tmp_path``)."""
    out = tmp_path / "tiny-tools"
    shutil.copytree(default_model_path(), out)
    (out / "chat_template.jinja").write_text(template)
    return out
