"""Chat templates: variables passed to the template, continue_final_message, and the sandbox
that keeps a template from reaching Python internals."""

import json
import shutil

import pytest

from slora.tokenizer import Tokenizer

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% if not enable_thinking %}<no-think>"
            "{% endif %}{% endif %}")


def with_template(model_dir, tmp_path, template: str) -> Tokenizer:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    conf = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**conf, "chat_template": template}))
    return Tokenizer(tmp_path)


def test_template_variables_and_continue_final_message(tiny_model_dir, tmp_path):
    tok = with_template(tiny_model_dir, tmp_path, TEMPLATE)
    chat = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(chat).endswith("<assistant><no-think>")
    assert tok.apply_chat_template(chat, variables={"enable_thinking": True}).endswith("<assistant>")
    # the template's own variables win over passed ones of the same name
    assert tok.apply_chat_template(chat, variables={"messages": []}).startswith("<user>Hi")
    chat.append({"role": "assistant", "content": "Paris is "})
    text = tok.apply_chat_template(chat, add_generation_prompt=False, continue_final_message=True)
    assert text == "<user>Hi</user>\n<assistant>Paris is"
    with pytest.raises(ValueError, match="add_generation_prompt"):
        tok.apply_chat_template(chat, continue_final_message=True)


def test_a_template_cannot_reach_python_internals(tiny_model_dir, tmp_path):
    from jinja2.exceptions import SecurityError

    tok = with_template(tiny_model_dir, tmp_path,
                        "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(SecurityError):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_templates_get_tools_tool_calls_and_hf_helpers(tiny_model_dir, tmp_path):
    """tools and tool calls reach the template; HF's helpers work: tojson, loop controls,
    {% generation %} blocks, strftime_now."""
    template = ("{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
                "{% generation %}{% endgeneration %}"
                "{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}"
                "<call>{{ c.function.name }} {{ c.function.arguments }}</call>{% break %}"
                "{% endfor %}{% elif m.role == 'tool' %}<result {{ m.tool_call_id }}>"
                "{{ m.content }}</result>{% else %}<{{ m.role }}>{{ m.content }}{% endif %}"
                "{% endfor %}{{ strftime_now('%Y')[:2] }}"
                "{% for m in messages %}{% generation %}{{ m.role[0] }}{% endgeneration %}"
                "{% endfor %}")
    tok = with_template(tiny_model_dir, tmp_path, template)
    tools = [{"type": "function", "function": {"name": "f", "description": "<a & b>"}}]
    calls = [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
             {"id": "2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "",
                                               "tool_calls": calls},
            {"role": "tool", "content": "42", "tool_call_id": "1"}]
    text = tok.apply_chat_template(chat, add_generation_prompt=False, variables={"tools": tools})
    assert text == (f"<tools>{json.dumps(tools)}</tools><user>Hi<call>f {{}}</call>"
                    "<result 1>42</result>20uat")
