#!/usr/bin/env python3
"""Makes tests/chat/goldens.json: what Hugging Face transformers renders for
each chat template of tests/chat/templates/ (real models' templates, see
SOURCES there) and for the small feature templates below, over several
message lists. tests/check_chat.c renders the same cases with libmlens and
compares byte for byte.

Run by hand when cases change (needs network once):
    pip install transformers jinja2
    python3 tests/chat/make_goldens.py
and commit the JSON it writes. It uses transformers' own renderer
(transformers.utils.chat_template_utils.render_jinja_template), the code
behind tokenizer.apply_chat_template(tokenize=False)."""
import datetime
import json
import os
import sys

import jinja2
import transformers
from transformers.utils.chat_template_utils import render_jinja_template

HERE = os.path.dirname(os.path.abspath(__file__))

# ---- message lists -------------------------------------------------------

USER = [{"role": "user", "content": "Hello! Who are you?"}]
SYS_USER = [{"role": "system", "content": "You are a terse assistant."}] + USER
MULTI = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "  And of Italy?  "},
]
SYS_MULTI = [{"role": "system", "content": "Answer in one word.\nBe polite."}] + MULTI
UNICODE = [
    {"role": "user", "content": "Grüße aus Köln — \"quoted\", a\ttab, \\ backslash, 😀 emoji"},
]
BAD_ROLES = [
    {"role": "user", "content": "one"},
    {"role": "user", "content": "two"},
]
BAD_ROLE_NAME = [{"role": "narrator", "content": "Once upon a time"}]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TOOLS = {"tools": [WEATHER_TOOL]}

TOOL_TURNS = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "Weather in Paris and Köln?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call00001", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}},
        {"id": "call00002", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Köln"}}},
    ]},
    {"role": "tool", "tool_call_id": "call00001", "content": "{\"temp\": 21.5}"},
    {"role": "tool", "tool_call_id": "call00002", "content": "{\"temp\": 18}"},
    {"role": "assistant", "content": "Paris 21.5 °C, Köln 18 °C."},
    {"role": "user", "content": "Thanks!"},
]
# Nemo's template insists on the assistant message with tool calls having no
# content key it reads and ids of nine characters.
NEMO_TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "tool_calls": [
        {"id": "abcDEF123", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "abcDEF123", "content": "sunny, 21"},
    {"role": "assistant", "content": "It is sunny."},
    {"role": "user", "content": "And tomorrow?"},
]
NEMO_BAD_ID = [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "tool_calls": [
        {"id": "short", "type": "function", "function": {"name": "get_weather", "arguments": {}}}]},
]

QWEN3_THINK = [
    {"role": "system", "content": "Think step by step."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nTwo plus two.\n</think>\n\nIt is 4."},
    {"role": "user", "content": "And 3+3?"},
]
QWEN3_REASONING_FIELD = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
]
QWEN3_TOOL_LOOP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "<think>\nNeed a tool.\n</think>\n\nLet me check.",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                       "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "<think>\nGot it.\n</think>\n\nSunny.", },
]

LLAMA_TOOL_TURNS = [
    {"role": "system", "content": "  You can call tools.  "},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "sunny, 21"},
    {"role": "assistant", "content": "It is sunny."},
]
LLAMA_BUILTIN = [
    {"role": "user", "content": "Search for mlens"},
    {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "brave_search", "arguments": {"query": "mlens"}}}]},
    {"role": "ipython", "content": "results"},
]
LLAMA_TWO_CALLS = [
    {"role": "user", "content": "x"},
    {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "a", "arguments": {}}},
        {"type": "function", "function": {"name": "b", "arguments": {}}}]},
]

RICH_TOOLS = {"tools": [WEATHER_TOOL, {
    "type": "function",
    "function": {
        "name": "search",
        "description": "  Search the web  ",
        "parameters": {
            "type": "object",
            "properties": {
                "queries": {"type": "array", "items": {"type": "string"}, "description": "What to search"},
                "limit": {"type": ["integer", "string"], "description": "At most this many"},
                "filters": {"type": "object", "additionalProperties": {"type": "boolean"},
                            "description": "Named filters"},
                "raw": {"description": "Anything"},
            },
        },
        "return": {"type": "array", "description": "The hits"},
    }}, {"type": "function", "function": {"name": "noop", "description": "Nothing",
                                          "parameters": {"type": "object", "properties": {}}}}]}

# OpenAI-style: null content beside tool calls, arguments as a JSON string
DEEPSEEK_TOOL_TURNS = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather in Paris and Köln?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
        {"id": "c2", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Köln\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "21"},
    {"role": "tool", "tool_call_id": "c2", "content": "18"},
    {"role": "assistant", "content": "<think>\nboth warm\n</think>\n\nParis 21, Köln 18."},
    {"role": "user", "content": "Thanks"},
]

GPT_OSS_TURNS = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "thinking": "Need the tool.", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "{\"temp\": 21}"},
    {"role": "assistant", "content": "21 °C.", "reasoning_content": "Read it."},
]
GPT_OSS_ORPHAN_TOOL = [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]

# ---- the real templates --------------------------------------------------

S, ES = "<s>", "</s>"
REAL = [
    # file, bos, eos, [(case name, messages, extra)]
    ("mixtral-8x7b-instruct", S, ES, [
        ("user", USER, None), ("multi", MULTI, None), ("unicode", UNICODE, None),
        ("bad_roles", BAD_ROLES, None), ("system_rejected", SYS_USER, None)]),
    ("mistral-7b-instruct-v0.1", S, ES, [
        ("user", USER, None), ("multi", MULTI, None), ("bad_roles", BAD_ROLES, None)]),
    ("mistral-7b-instruct-v0.2", S, ES, [
        ("user", USER, None), ("sys_multi", SYS_MULTI, None), ("bad_roles", BAD_ROLES, None),
        ("bad_role_name", BAD_ROLE_NAME, None)]),
    ("mistral-nemo-instruct-2407", S, ES, [
        ("user", USER, None), ("sys_multi", SYS_MULTI, None), ("tools", SYS_MULTI, TOOLS),
        ("tool_turns", NEMO_TOOL_TURNS, TOOLS), ("bad_id", NEMO_BAD_ID, TOOLS),
        ("bad_roles", BAD_ROLES, None)]),
    ("chatml", S, "<|im_end|>", [
        ("user", USER, None), ("sys_multi", SYS_MULTI, None), ("unicode", UNICODE, None)]),
    ("qwen2-instruct", None, "<|im_end|>", [
        ("user", USER, None), ("sys_multi", SYS_MULTI, None)]),
    ("qwen2.5-instruct", None, "<|im_end|>", [
        ("user", USER, None), ("sys_multi", SYS_MULTI, None), ("tools", SYS_USER, TOOLS),
        ("tools_no_system", USER, TOOLS), ("tool_turns", TOOL_TURNS, TOOLS),
        ("unicode", UNICODE, None)]),
    ("qwen3", None, "<|im_end|>", [
        ("user", USER, None), ("sys_multi", SYS_MULTI, None), ("think", QWEN3_THINK, None),
        ("no_thinking", QWEN3_THINK, {"enable_thinking": False}),
        ("reasoning_field", QWEN3_REASONING_FIELD, None), ("tools", SYS_USER, TOOLS),
        ("tool_turns", TOOL_TURNS, TOOLS), ("tool_loop", QWEN3_TOOL_LOOP, TOOLS),
        ("unicode", UNICODE, TOOLS)]),
    ("dbrx-instruct", "<|endoftext|>", "<|endoftext|>", [
        ("user", USER, None), ("sys_multi", SYS_MULTI, None), ("multi", MULTI, None)]),
    ("llama-3-instruct", "<|begin_of_text|>", "<|eot_id|>", [
        ("user", USER, None), ("sys_multi", SYS_MULTI, None)]),
    ("llama-3.3-instruct", "<|begin_of_text|>", "<|eot_id|>", [
        ("user", USER, None), ("sys_multi", SYS_MULTI, None), ("tools", SYS_USER, TOOLS),
        ("tool_turns", LLAMA_TOOL_TURNS, TOOLS),
        ("tools_in_system", LLAMA_TOOL_TURNS, dict(TOOLS, tools_in_user_message=False,
                                                   date_string="3 Dec 2026")),
        ("builtin_tools", LLAMA_BUILTIN, {"builtin_tools": ["brave_search", "code_interpreter"]}),
        ("two_calls", LLAMA_TWO_CALLS, None), ("no_user_for_tools", [], TOOLS)]),
    ("hermes-3-llama-3.1-tool-use", "<|begin_of_text|>", "<|im_end|>", [
        ("tools", SYS_USER, RICH_TOOLS), ("tool_turns", TOOL_TURNS, TOOLS),
        ("qwen3_tool_loop", QWEN3_TOOL_LOOP, RICH_TOOLS)]),
    ("olmo-2-instruct", "<|endoftext|>", "<|endoftext|>", [
        ("user", USER, None), ("sys_multi", SYS_MULTI, None), ("multi", MULTI, None)]),
    ("deepseek-r1-distill-qwen", "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
     "<\uff5cend\u2581of\u2581sentence\uff5c>", [
        ("user", USER, None), ("think", QWEN3_THINK, None), ("tool_turns", DEEPSEEK_TOOL_TURNS, None),
        ("tool_last", DEEPSEEK_TOOL_TURNS[:5], None)]),
    ("gpt-oss", "<|startoftext|>", "<|return|>", [
        ("user", USER, None), ("sys_multi", SYS_MULTI, None), ("tools", SYS_USER, RICH_TOOLS),
        ("tool_turns", GPT_OSS_TURNS, TOOLS),
        ("builtin", USER, {"builtin_tools": ["browser", "python"], "reasoning_effort": "high",
                           "model_identity": "You are a test model."}),
        ("orphan_tool", GPT_OSS_ORPHAN_TOOL, None)]),
    ("tulu-2", S, ES, [
        ("user", USER, None), ("multi", MULTI, None)]),
    ("deepseek-coder-instruct", "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<|EOT|>", [
        ("user", USER, None), ("sys_multi", SYS_MULTI, None)]),
]

# ---- small templates, one feature family each ----------------------------

FEATURES = {
    "loop_vars": (
        "{% for m in messages %}{{ loop.index }}/{{ loop.length }} {{ loop.index0 }} "
        "{{ loop.revindex }} {{ loop.revindex0 }} {{ loop.first }} {{ loop.last }} "
        "{{ loop.previtem.role if loop.previtem is defined else '-' }} "
        "{{ loop.nextitem.role if loop.nextitem is defined else '-' }}\n{% endfor %}"),
    "loop_else_filter": (
        "{% for m in messages if m.role == 'assistant' %}{{ m.content }}|{{ loop.length }}"
        "{% else %}none{% endfor %};"
        "{% for m in [] %}x{% else %}empty{% endfor %};"
        "{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}"
        "{% if i > 4 %}{% break %}{% endif %}{{ i }}{% endfor %}"),
    "items_unpack": (
        "{% for k, v in {'b': 1, 'a': [1, 2], 'c': {'x': none}}.items() %}{{ k }}={{ v }};{% endfor %}"
        "{% for k, v in messages[0]|items %}{{ k }}:{{ v }},{% endfor %}"
        "{% for a, b in [(1, 2), [3, 4]] %}{{ a + b }}{% endfor %}"),
    "namespace_set": (
        "{% set ns = namespace(n=0, s='') %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% set ns.s = ns.s ~ m.role[0] %}{% set local = 5 %}{% endfor %}"
        "{{ ns.n }} {{ ns.s }} {{ local is defined }}"
        "{% set a, b = 1, 'two' %} {{ a }}{{ b }}"
        "{% set block %}  inner {{ a }}  {% endset %}[{{ block }}]"),
    "macro_call": (
        "{% macro tag(name, body='-') %}<{{ name }}>{{ body }}</{{ name }}>{% endmacro %}"
        "{{ tag('a') }}{{ tag('b', 'x') }}{{ tag(body='y', name='c') }}"
        "{% macro wrap(cls) %}[{{ cls }}:{{ caller() }}]{% endmacro %}"
        "{% call wrap('w') %}inside {{ messages|length }}{% endcall %}"),
    "expressions": (
        "{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} "
        "{{ 1 + 2 * 3 - 4 }} {{ 'a' ~ 1 ~ none }} {{ 'ab' * 3 }} {{ [1] + [2, 3] }} "
        "{{ 1 < 2 < 3 }} {{ 3 > 2 > 5 }} {{ not true or false }} {{ 0 or '' or 'x' }} "
        "{{ 1 and 'y' }} {{ 'b' in 'abc' }} {{ 4 not in [1, 2] }} {{ 'role' in messages[0] }} "
        "{{ 'yes' if messages else 'no' }} {{ (1, 'a') }} {{ (1,) }} {{ {'k': [1.5, true, none]} }} "
        "{{ 0.1 + 0.2 }} {{ 1e20 }} {{ 1.0 }} {{ 2.5e-5 }} {{ -0.0 }} {{ 10 / 4 }} {{ 1 == 1.0 }}"),
    "tests": (
        "{{ x is defined }} {{ messages is defined }} {{ none is none }} {{ 'a' is string }} "
        "{{ 1 is number }} {{ 1.5 is float }} {{ 1 is integer }} {{ {} is mapping }} "
        "{{ [] is iterable }} {{ 'x' is sequence }} {{ true is true }} {{ false is false }} "
        "{{ 0 is false }} {{ 3 is odd }} {{ 4 is even }} {{ 9 is divisibleby 3 }} "
        "{{ 2 is eq 2 }} {{ 'abc' is lower }} {{ 'A' is upper }} {{ x is not defined }} "
        "{{ messages[0].missing is undefined }} {{ 2 is in [1, 2] }}"),
    "string_methods": (
        "{% set s = '  Hello, World  ' %}[{{ s.strip() }}][{{ s.lstrip() }}][{{ s.rstrip() }}]"
        "[{{ 'xxhixx'.strip('x') }}][{{ s.split(',') }}][{{ 'a b  c'.split() }}]"
        "[{{ 'a-b-c'.split('-', 1) }}][{{ s.replace('l', 'L') }}][{{ 'abc'.upper() }}]"
        "[{{ 'ABC'.lower() }}][{{ 'hello world'.title() }}][{{ 'hELLO'.capitalize() }}]"
        "[{{ 'abc'.startswith('ab') }}][{{ 'abc'.endswith(('x', 'c')) }}]"
        "[{{ '{} and {}'.format(1, 'two') }}][{{ '{a}-{0}'.format('p', a='q') }}]"
        "[{{ ', '.join(['x', 'y']) }}][{{ 'hello'.find('l') }}][{{ 'hello'.count('l') }}]"),
    "slices_subscripts": (
        "{% set l = [0, 1, 2, 3, 4, 5] %}{{ l[1:3] }} {{ l[::-1] }} {{ l[::2] }} {{ l[-2:] }} "
        "{{ l[:-4] }} {{ l[4:1:-1] }} {{ l[-1] }} {{ l[10] is defined }} {{ 'héllo'[1] }} "
        "{{ 'héllo'[::-1] }} {{ 'abcdef'[2:] }} {{ messages[0]['role'] }} {{ messages[0].role }} "
        "{{ messages[-1]['content'][:5] }}"),
    "filters": (
        "{{ messages|length }} {{ 'héllo'|length }} {{ '  pad  '|trim }} {{ 'abc'|upper }} "
        "{{ 'ABC'|lower }} {{ 'hello world'|capitalize }} {{ 'hello world'|title }} "
        "{{ [3, 1, 2]|first }} {{ [3, 1, 2]|last }} {{ 'abc'|first }} {{ [1, 2, 3]|join('-') }} "
        "{{ messages|map(attribute='role')|join(',') }} {{ x|default('dflt') }} "
        "{{ ''|default('empty', true) }} {{ 'abc'|list }} {{ [1, 2, 3]|reverse|list }} "
        "{{ 'abc'|reverse }} {{ 'aXbX'|replace('X', 'y') }} {{ '42'|int + 1 }} {{ '4.7'|int }} "
        "{{ 'x'|int }} {{ 3.9|int }} {{ '2.5'|float }} {{ 42|string ~ '!' }} "
        "{{ {'b': 2, 'A': 1, 'c': 0}|dictsort }} {{ [1, 2, 1, 3, 2]|unique|list }} "
        "{{ ['b', 'a', 'C']|sort }} {{ [3, 1, 2]|max }} {{ [3, 1, 2]|min }} {{ [1, 2, 3]|sum }} "
        "{{ messages|selectattr('role', 'equalto', 'user')|list|length }} "
        "{{ messages|rejectattr('role', 'equalto', 'user')|map(attribute='role')|list }} "
        "{{ [0, 1, '', 'a']|select|list }} {{ [1, 2, 3, 4]|select('odd')|list }} "
        "{{ [1, 2, 3, 4]|reject('even')|list }} {{ ['a', 'b']|map('upper')|list }} "
        "{{ 'x'|safe }} {{ -3|abs }} {{ 'line1\nline2\n\nline3'|indent(2) }}|"
        "{{ 'a\nb'|indent(2, true) }}"),
    "tojson": (
        "{{ messages|tojson }}\n{{ messages[0]|tojson(indent=2) }}\n"
        "{{ {'z': 1, 'a': [1.5, true, none, 'é\"\\\\\n\t\u0001']}|tojson }}\n"
        "{{ {'z': 1, 'a': 2}|tojson(sort_keys=true) }}\n{{ [[], {}]|tojson(indent=4) }}\n"
        "{{ 'ü'|tojson(ensure_ascii=true) }} {{ '😀'|tojson(ensure_ascii=true) }}\n"
        "{{ [1, 2]|tojson(separators=(',', ':')) }} {{ 1e300 * 10 }}"),
    "whitespace": (
        "a\n  {% if true %}\n    b\n  {% endif %}\n"
        "c {{- ' d ' -}} e\n"
        "  {%- if true %} f {% endif -%}  \n"
        "  {%+ if true %}g{% endif %}\n"
        "{# a comment #}\n"
        "  {#- trimmed comment -#}  h\n"
        "{% raw %}{{ not evaluated }}{% endraw %}\n"
        "  {% if true +%}\ni{% endif %}\n"
        "{% for i in range(2) %}\n  {{ i }}\n{% endfor %}\nend\n"),
    "undefined": (
        "[{{ nothing }}][{{ messages[0].missing }}][{{ nothing|default('d') }}]"
        "[{{ nothing is defined }}][{{ nothing|length }}][{% for x in nothing %}x{% endfor %}]"
        "[{{ 'yes' if nothing else 'no' }}][{{ nothing == nothing }}][{{ nothing ~ 'c' }}]"
        "[{{ tools is none }}][{{ documents is none }}][{{ bos_token }}][{{ eos_token }}]"),
    "generation_prompt": (
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}|{% endfor %}"
        "{% if add_generation_prompt %}GEN{% endif %}{{ add_generation_prompt }}"),
    "dict_methods": (
        "{% set d = messages[0] %}{{ d.get('role') }} {{ d.get('nope') }} {{ d.get('nope', 'x') }} "
        "{{ d.keys()|list }} {{ d.values()|list|length }} {{ d.items()|list|length }} "
        "{{ dict(a=1, b='c') }} {{ d['role'] }}"),
    "edge_cases": (
        "{{ \"o'neil mc-d (x)\"|title }} {{ \"o'neil 1st\".title() }} {{ '0x1A'|int }} "
        "{{ ' 12 '|int }} {{ '1e3'|float }} {{ 'nan'|int }} {{ 'abc'[10:] }}|{{ 'a,b,,c'.split(',') }} "
        "{{ messages|selectattr('content')|list|length }} {{ [1, 2] == [1, 2] }}"),
    "attribute_paths": (
        "{% set tc = [{'function': {'name': 'f', 'n': 2}}, {'function': {'name': 'g', 'n': 1}}] %}"
        "{{ tc|map(attribute='function.name')|join(',') }} "
        "{{ tc|selectattr('function.name', 'eq', 'g')|list|length }} "
        "{{ [[1, 2], [3, 4]]|map(attribute='0')|list }} {{ [[1, 2], [3, 4]]|map(attribute=1)|list }} "
        "{{ tc|sort(attribute='function.n')|map(attribute='function.name')|list }} "
        "{{ tc|sum(attribute='function.n') }} {{ tc|join('/', attribute='function.name') }}"),
    "percent_cycle": (
        "{{ '%s and %r' % ('a', 'b') }} {{ '%d%%' % 5.7 }} {{ '%i' % true }} {{ '%s' % [1, 2] }} "
        "{% for m in messages %}{{ loop.cycle('odd', 'even') }} {% endfor %}"),
    "unicode_space": (
        "[{{ '\u00a0\u3000 x \u2003y\u00a0\n'|trim }}][{{ '\u00a0a\u2028b  c\u205f'.split() }}]"
        "[{{ 'a\u00a0b c'.split(none, 1) }}][{{ '\x1fz\x85'.strip() }}][{{ 'é'.strip() }}]"),
    "jinja_quirks": (
        "[{{ (7)[1:] }}][{{ {'a': 1}[::-1] is defined }}][{{ 0|map('string')|list }}]"
        "[{{ none|select|list }}][{{ false|selectattr('x')|list }}][{{ 12 is lower }}]"
        "[{{ [1, 'a'] is lower }}][{{ -0.25 is odd }}][{{ 3.0 is odd }}][{{ 4.5 is divisibleby 1.5 }}]"
        "[{{ true is odd }}][{{ -3 is odd }}]{% for m in messages %}[{{ loop }}]{% endfor %}"),
    "unicode_case": (
        "{% set s = 'ÉCOLE ñandú Straße ΟΔΥΣΣΕΥΣ ΣΑΣ привет ĲĳŁł Ÿÿ µ ĸ ŉ İı ſ ΆΈΉΊΌΎΏ άέήίόύώ ΪΫ ЁЂѐђ "
        "abcXYZ 123' %}{{ s|lower }}\n{{ s|upper }}\n{{ s.lower() }}\n{{ s.upper() }}\n"
        "{{ 'élan vital ßtraße 3rd ÉCOLE-été (ñu)'|title }} {{ 'élan vital ßtraße 3rd ÉCOLE-été'.title() }}\n"
        "{{ 'élan VITAL'|capitalize }} {{ 'ßa'.capitalize() }} {{ 'Σ'|lower }} {{ 'ΑΣ Σ.'|lower }} "
        "{{ 'ÉCOLE' is upper }} {{ 'école' is lower }} {{ 'Éc' is lower }} {{ 'ß' is lower }}\n"
        "{{ ['É', 'a', 'é']|unique|list }} {{ ['b', 'É', 'a', 'é']|sort }} {{ {'É': 1, 'a': 2}|dictsort }}"),
    "raise": (
        "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
        "{{ raise_exception('Unknown role: ' + m.role) }}{% endif %}{{ m.content }}{% endfor %}"),
}
FEATURE_CASES = [
    ("sys_multi", SYS_MULTI, None),
    ("user_extra", USER, {"documents": [{"title": "T", "text": "body"}], "custom": 3}),
]
RAISE_CASES = [("ok", MULTI, None), ("bad", SYS_USER, None)]


def render(text, bos, eos, messages, add_gen, extra):
    kwargs = {}
    if bos is not None:
        kwargs["bos_token"] = bos
    if eos is not None:
        kwargs["eos_token"] = eos
    extra = dict(extra or {})
    tools = extra.pop("tools", None)
    documents = extra.pop("documents", None)
    kwargs.update(extra)
    try:
        today = datetime.date.today().strftime("%Y-%m-%d")
        out, _ = render_jinja_template(conversations=[messages], tools=tools, documents=documents,
                                       chat_template=text, add_generation_prompt=add_gen, **kwargs)
        if "strftime_now" in text:
            # check_chat puts the day it runs back in place of %TODAY%
            return {"expected": out[0].replace(today, "%TODAY%")}
        return {"expected": out[0]}
    except jinja2.exceptions.UndefinedError as e:
        # an undefined value used: libmlens says the same, after the line
        return {"error": str(e), "error_type": "undefined"}
    except jinja2.exceptions.TemplateError as e:
        # raise_exception(): libmlens returns the template's message as is
        return {"error": str(e), "error_type": "raise"}


def main():
    cases = []
    for name, bos, eos, msgsets in REAL:
        with open(os.path.join(HERE, "templates", name + ".jinja"), encoding="utf-8") as f:
            text = f.read()
        for cname, msgs, extra in msgsets:
            for add_gen in (False, True):
                c = {"name": "%s/%s/%s" % (name, cname, "gen" if add_gen else "nogen"),
                     "template": name, "bos_token": bos, "eos_token": eos, "messages": msgs,
                     "add_generation_prompt": add_gen, "extra": extra}
                c.update(render(text, bos, eos, msgs, add_gen, extra))
                cases.append(c)
    for fname, text in FEATURES.items():
        for cname, msgs, extra in (RAISE_CASES if fname == "raise" else FEATURE_CASES):
            for add_gen in (False, True):
                c = {"name": "feature/%s/%s/%s" % (fname, cname, "gen" if add_gen else "nogen"),
                     "template_text": text, "bos_token": "<s>", "eos_token": "</s>",
                     "messages": msgs, "add_generation_prompt": add_gen, "extra": extra}
                c.update(render(text, "<s>", "</s>", msgs, add_gen, extra))
                cases.append(c)
    out = {"generator": "tests/chat/make_goldens.py",
           "transformers": transformers.__version__, "jinja2": jinja2.__version__,
           "cases": cases}
    with open(os.path.join(HERE, "goldens.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print("%d cases" % len(cases), file=sys.stderr)


if __name__ == "__main__":
    main()
