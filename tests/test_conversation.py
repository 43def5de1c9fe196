"""The Conversation object MLC's engine builds prompts from, and tokenizer_info (pipeline/artifacts/).

The point: the prompt MLC's engine assembles from a bundle's mlc-chat-config.json (`render_prompt`, restated from
cpp/json_ffi/conv_template.cc) is, text and tokens, what `python -m pipeline run` feeds the model (transformers'
apply_chat_template(..., add_generation_prompt=True) on the bundle's tokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from pipeline.artifacts import conversation as conv_mod
from pipeline.artifacts.conversation import (
    PROBES,
    bundle_conversation,
    chat_template,
    default_system_message,
    engine_text,
    load_template,
    render_chat_template,
    render_prompt,
)
from pipeline.artifacts.tokenizer_info import DEFAULT_INFO, detect_tokenizer_info, token_table
from pipeline.errors import ConfigError, WeightsError

ROOT = Path(__file__).resolve().parent.parent
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CONVERSATIONS = {
    "user": [{"role": "user", "content": "What is the capital of France?"}],
    "system,user": [{"role": "system", "content": "You answer in French."},
                    {"role": "user", "content": "What is the capital of France?"}],
    "user,assistant,user": [{"role": "user", "content": "Hi!"},
                            {"role": "assistant", "content": "Hello, how can I help?"},
                            {"role": "user", "content": "Name three colours.\nOne per line."}],
}


# ------------------------------------------------------------------------------ SmolLM2's real tokenizer
@pytest.fixture(scope="module")
def smol_tokenizer(tmp_path_factory, smollm2_gguf) -> Path:
    """The tokenizer files a smollm2-135m bundle gets (emit writes them with the same call)."""
    from pipeline.frontend.gguf_file import GGUFCheckpoint

    folder = tmp_path_factory.mktemp("smol-tokenizer")
    GGUFCheckpoint(smollm2_gguf).write_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def hf_tokenizer(smol_tokenizer):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smol_tokenizer))


def _hf_ids(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)


@pytest.mark.parametrize("case", list(CONVERSATIONS))
def test_engine_prompt_equals_apply_chat_template(smol_tokenizer, hf_tokenizer, case):
    """chatml fitted to SmolLM2's tokenizer: the engine's prompt is apply_chat_template's, as text and as the
    token ids the runner prefills (the engine encodes the text without adding special tokens)."""
    messages = CONVERSATIONS[case]
    fitted = bundle_conversation("chatml", smol_tokenizer, [2])
    assert fitted.warnings == []
    prefix, text = render_prompt(fitted.conv, messages)
    want = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prefix == [] and text == want
    assert hf_tokenizer.encode(text, add_special_tokens=False) == _hf_ids(hf_tokenizer, messages)


def test_default_system_message_comes_from_the_chat_template(smol_tokenizer):
    assert load_template("chatml")["system_message"].startswith("A conversation between a user")   # MLC's
    fitted = bundle_conversation("chatml", smol_tokenizer, [2])
    assert fitted.conv["system_message"] == SMOL_SYSTEM
    assert fitted.conv["stop_token_ids"] == [2]            # <|im_end|>: eos, and the stop string is one token
    text = render_prompt(fitted.conv, CONVERSATIONS["user"])[1]
    assert text.startswith(f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n<|im_start|>user\n")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_our_jinja_rendering_is_transformers(smol_tokenizer, hf_tokenizer):
    template = chat_template(smol_tokenizer)
    assert template and "SmolLM" in template
    for messages in [*CONVERSATIONS.values(), *PROBES.values()]:
        for gen in (True, False):
            want = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            assert render_chat_template(template, messages, add_generation_prompt=gen,
                                        **conv_mod.special_tokens(smol_tokenizer)) == want


def test_jinja_features_render_as_in_transformers(hf_tokenizer):
    """{% generation %} blocks, tojson without HTML escaping, loop controls, the special tokens."""
    template = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
                "{% if m.role == 'assistant' %}{% generation %}A:{{ m.content }}{% endgeneration %}"
                "{% else %}U:{{ m.content }}{% endif %}{% endfor %}{{ messages | tojson }}{{ eos_token }}")
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "h\u00e9 <b> & \"q\""},
                {"role": "assistant", "content": "x"}]
    want = hf_tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert render_chat_template(template, messages, add_generation_prompt=False,
                                bos_token="<|im_start|>", eos_token="<|im_end|>") == want


def test_smollm2_tokenizer_info(smol_tokenizer):
    assert detect_tokenizer_info(smol_tokenizer) == {"token_postproc_method": "byte_level",
                                                     "prepend_space_in_encode": False, "strip_space_in_decode": False}


def _fake_loaded(model_file: Path | None = None, conv_template: str = "chatml"):
    decoder = SimpleNamespace(family="llama", vocab_size=49152, context_window_size=2048, prefill_chunk_size=256,
                              to_json=lambda: {"hidden_size": 576})
    spec = SimpleNamespace(conv_template=conv_template, path=model_file)
    return SimpleNamespace(decoder=decoder, generation_config={"eos_token_id": 2}, spec=spec,
                           hf_config={"architectures": ["LlamaForCausalLM"], "bos_token_id": 1})


BUILD_INFO = {"library": "m.so", "system_lib_prefix": "m_q4f16_",
              "metadata": {"activation_dtype": "float32", "weight_layout": "KN"}}


def test_chat_config_carries_the_fitted_conversation(smol_tokenizer):
    from pipeline.artifacts.chat_config import chat_config

    lines: list[str] = []
    report = SimpleNamespace(info=lines.append)
    cfg = chat_config(_fake_loaded(), SimpleNamespace(name="q4f16"), BUILD_INFO,
                      ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"], smol_tokenizer, report)
    assert lines == []
    conv = cfg["conv_template"]
    assert isinstance(conv, dict) and conv["system_message"] == SMOL_SYSTEM and conv["name"] == "chatml"
    assert "system_prefix_token_ids" not in conv          # unset optional fields are left out, as MLC writes them
    assert cfg["tokenizer_info"]["token_postproc_method"] == "byte_level"
    json.dumps(cfg)
    bare = chat_config(_fake_loaded(), SimpleNamespace(name="q4f16"), BUILD_INFO, [], None)
    assert bare["tokenizer_info"] == DEFAULT_INFO and bare["conv_template"]["system_message"].startswith("A conv")


def test_a_template_that_does_not_fit_is_warned_about(smol_tokenizer):
    """llama-3's Conversation on SmolLM2's ChatML tokenizer: every probe differs, each said in one line."""
    from pipeline.artifacts.chat_config import chat_config

    lines: list[str] = []
    chat_config(_fake_loaded(conv_template="llama-3"), SimpleNamespace(name="q4f16"), BUILD_INFO,
                ["tokenizer.json"], smol_tokenizer, SimpleNamespace(info=lines.append))
    assert len(lines) == 1 + len(PROBES)
    assert "renders no default system turn that conv_template llama-3 can hold" in lines[0]
    assert "another prompt than the tokenizer's chat template for [user]" in lines[1]
    assert all("\n" not in line and line.startswith("[yellow]warning:[/]") for line in lines)


# ------------------------------------------------------------------------- conv_template.cc's rules
def _conv(**over):
    return {**load_template("chatml"), "system_message": "S", **over}


LLAMA2 = {"system_template": "[INST] <<SYS>>\n{system_message}\n<</SYS>>\n\n", "system_message": "S",
          "roles": {"user": "<s>[INST]", "assistant": "[/INST]", "tool": "[INST]"}, "seps": [" ", " </s>"],
          "role_content_sep": " ", "role_empty_sep": " ", "add_role_after_system_message": False}


@pytest.mark.parametrize("over, messages, want", [
    ({}, CONVERSATIONS["user"],
     "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
     "<|im_start|>assistant\n"),
    # several system messages are concatenated in place of the template's
    ({}, [{"role": "system", "content": "A"}, {"role": "user", "content": "u"}, {"role": "system", "content": "B"}],
     "<|im_start|>system\nAB<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n"),
    # two separators: seps[0] after the user, seps[1] after the assistant; no role before the first message
    # when add_role_after_system_message is false and there is a system text
    (LLAMA2, CONVERSATIONS["user,assistant,user"],
     "[INST] <<SYS>>\nS\n<</SYS>>\n\nHi! [/INST] Hello, how can I help? </s><s>[INST] Name three colours.\n"
     "One per line. [/INST] "),
    # ... but with an empty system text the first message gets its role
    ({**LLAMA2, "system_template": "{system_message}", "system_message": ""}, CONVERSATIONS["user"],
     "<s>[INST] What is the capital of France? [/INST] "),
    # a placeholder is replaced once (the first occurrence); no placeholder: the text is not inserted
    ({"role_templates": {"user": "Q: {user_message} ({user_message})", "assistant": "{assistant_message}",
                         "tool": "{tool_message}"}}, CONVERSATIONS["user"],
     "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ: What is the capital of France? ({user_message})"
     "<|im_end|>\n<|im_start|>assistant\n"),
    ({"system_template": "fixed\n"}, CONVERSATIONS["system,user"],
     "fixed\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"),
    # the template's own messages come before the request's
    ({"messages": [["user", "m1"], ["assistant", "m2"]]}, [{"role": "user", "content": "u"}],
     "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nm1<|im_end|>\n<|im_start|>assistant\nm2<|im_end|>\n"
     "<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n"),
])
def test_render_prompt_rules(over, messages, want):
    assert render_prompt(_conv(**over), messages) == ([], want)


def test_strip_reasoning_in_history():
    conv = _conv(strip_reasoning_in_history=True, system_template="")
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>x</think>\n\nb"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "<think>y</think>\nd"}]
    text = render_prompt(conv, msgs)[1]
    assert "assistant\nb<|im_end|>" in text and "<think>x" not in text
    assert "<think>y</think>\nd" in text                   # after the last user turn: kept


def test_render_prompt_refuses_what_the_engine_refuses():
    with pytest.raises(ValueError, match='Role "tool" is not supported'):
        render_prompt(_conv(), [{"role": "tool", "content": "x"}])


def test_llama3_prefix_tokens_and_a_chat_template_without_default_system():
    """llama-3: <|begin_of_text|> is the prefix token id, not text; Meta's template renders no system turn
    unless given one, so only conversations with a system message can match (MLC's preset has a default)."""
    template = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
                "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
                "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
                "{{ content }}{% endfor %}{% if add_generation_prompt %}"
                "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
    conv = load_template("llama-3")
    table = {"<|begin_of_text|>": 128000}
    assert render_prompt(conv, CONVERSATIONS["user"]) == ([128000], (
        "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful, respectful and honest assistant.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of France?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"))
    for messages in (CONVERSATIONS["system,user"],
                     [{"role": "system", "content": "S"}, *CONVERSATIONS["user,assistant,user"]]):
        want = render_chat_template(template, messages, bos_token="<|begin_of_text|>")
        assert engine_text(conv, messages, table) == want
    rendered = render_chat_template(template, CONVERSATIONS["user"], bos_token="<|begin_of_text|>")
    assert default_system_message(conv, rendered, table) is None


# --------------------------------------------------------------------------------- templates as data
def test_every_template_has_every_field_the_engine_requires():
    required = [f for f, (req, _, _) in conv_mod.FIELDS.items() if req]
    for name, path in conv_mod.known_templates().items():
        raw = yaml.safe_load(path.read_text())
        assert set(raw) == set(conv_mod.FIELDS), name                      # written out in full
        conv = load_template(name)
        assert all(f in conv for f in required) and conv["name"] == name
        assert render_prompt(conv, CONVERSATIONS["user,assistant,user"])[1]
    assert {"chatml", "llama-3", "qwen2"} <= set(conv_mod.known_templates())


def test_every_model_config_names_a_known_template():
    from pipeline.config import MODELS, load_model

    for name in MODELS:
        load_template(load_model(name).conv_template, model_file=MODELS[name])


def _templates(tmp_path, monkeypatch, **files) -> Path:
    monkeypatch.setattr(conv_mod, "TEMPLATE_DIR", tmp_path)
    for name, text in files.items():
        (tmp_path / f"{name}.yaml").write_text(text)
    return tmp_path


GOOD_YAML = (ROOT / "configs" / "conv_templates" / "chatml.yaml").read_text()


@pytest.mark.parametrize("text, words", [
    ("a: [b", ["not valid YAML"]),
    ("- a\n- b\n", ["expected a mapping"]),
    (GOOD_YAML + "colour: red\n", ["unknown field(s) colour"]),
    (GOOD_YAML.replace("role_empty_sep:", "# role_empty_sep:"), ["missing field(s) role_empty_sep"]),
    (GOOD_YAML.replace("stop_token_ids: [2]", "stop_token_ids: ['2']"), ["stop_token_ids must be a list of token"]),
    (GOOD_YAML.replace('seps: ["<|im_end|>\\n"]', "seps: []"), ["seps must be a list of 1 or 2 strings"]),
    (GOOD_YAML.replace("add_role_after_system_message: true", "add_role_after_system_message: yes please"),
     ["add_role_after_system_message must be true or false"]),
    (GOOD_YAML.replace('  assistant: "<|im_start|>assistant"\n', "", 1), ["roles has no 'assistant'"]),
    (GOOD_YAML.replace("messages: []", "messages: [[user]]"), ["messages must be a list of [role, content]"]),
])
def test_malformed_template_is_one_line_naming_the_file(tmp_path, monkeypatch, text, words):
    _templates(tmp_path, monkeypatch, bad=text)
    with pytest.raises(ConfigError) as err:
        load_template("bad")
    message = str(err.value)
    assert "\n" not in message and str(tmp_path / "bad.yaml") in message and "fix:" in message
    for word in words:
        assert word in message


def test_unknown_template_names_the_model_file_and_the_known_ones(tmp_path, monkeypatch):
    _templates(tmp_path, monkeypatch, chatml=GOOD_YAML, other=GOOD_YAML)
    with pytest.raises(ConfigError) as err:
        load_template("vicuna", model_file=Path("configs/models/x.yaml"))
    message = str(err.value)
    assert message.startswith("configs/models/x.yaml: unknown conv_template 'vicuna'")
    assert "use one of: chatml, other" in message and "\n" not in message


def test_model_config_with_unknown_template_fails_at_load(tmp_path, monkeypatch):
    """Checked when the model config is read, before anything is loaded or compiled."""
    from pipeline import config

    path = tmp_path / "m.yaml"
    path.write_text("name: m\nconv_template: vicuna\n")
    monkeypatch.setitem(config.MODELS, "m", path)
    with pytest.raises(ConfigError) as err:
        config.load_model("m")
    message = str(err.value)
    assert message.startswith(f"{path}: unknown conv_template 'vicuna'") and "chatml" in message
    assert "\n" not in message


# ---------------------------------------------------------------- tokenizer_info, synthetic tokenizers
def _save(tmp_path: Path, name: str, tok) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _bpe(byte_fallback: bool = False):
    from tokenizers import Tokenizer, models

    vocab = {"<unk>": 0, "a": 1, "b": 2, "ab": 3, "\u2581": 4, **{f"<0x{i:02X}>": 5 + i for i in range(256)}}
    return Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")], unk_token="<unk>", byte_fallback=byte_fallback))


def test_llama2_style_tokenizer_is_byte_fallback_with_prepend_and_strip(tmp_path):
    from tokenizers import decoders, normalizers

    tok = _bpe(byte_fallback=True)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    assert detect_tokenizer_info(_save(tmp_path, "llama2", tok)) == {
        "token_postproc_method": "byte_fallback", "prepend_space_in_encode": True, "strip_space_in_decode": True}


def test_metaspace_tokenizer_is_byte_fallback_without_prepend(tmp_path):
    """A Metaspace decoder is neither ByteLevel nor ByteFallback: MLC falls back to byte_fallback; its prepend
    flag reads only the normalizer, not the Metaspace pre-tokenizer."""
    from tokenizers import decoders, pre_tokenizers

    tok = _bpe()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    assert detect_tokenizer_info(_save(tmp_path, "meta", tok)) == DEFAULT_INFO


@pytest.mark.parametrize("decoder, method", [
    (None, "byte_fallback"),                                         # no decoder: MLC's default
    ("ByteLevel", "byte_level"),
    ("fallback-then-level", "byte_level"),                           # in a Sequence the last match wins
    ("level-then-fallback", "byte_fallback"),
])
def test_decoder_kinds(tmp_path, decoder, method):
    from tokenizers import decoders

    tok = _bpe(byte_fallback=True)
    if decoder == "ByteLevel":
        tok.decoder = decoders.ByteLevel()
    elif decoder == "fallback-then-level":
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.ByteLevel()])
    elif decoder == "level-then-fallback":
        tok.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.ByteFallback()])
    info = detect_tokenizer_info(_save(tmp_path, "t", tok))
    assert info == {**DEFAULT_INFO, "token_postproc_method": method}


def test_no_tokenizer_json_gives_mlc_defaults(tmp_path):
    assert detect_tokenizer_info(tmp_path) == DEFAULT_INFO


@pytest.mark.parametrize("text, words", [
    ("{not json", ["cannot read the tokenizer"]),
    ("[1, 2]", ["not a JSON object"]),
    (json.dumps({"decoder": {"decoders": []}}), ['decoder has no "type"']),
    (json.dumps({"decoder": {"type": "Sequence"}}), ['Sequence without a "decoders" list']),
    (json.dumps({"normalizer": {"type": "Sequence", "normalizers": [{"prepend": "x"}]}}), ['normalizer has no "type"']),
])
def test_broken_tokenizer_json_is_one_line_naming_it(tmp_path, text, words):
    (tmp_path / "tokenizer.json").write_text(text)
    with pytest.raises(WeightsError) as err:
        detect_tokenizer_info(tmp_path)
    message = str(err.value)
    assert "\n" not in message and str(tmp_path / "tokenizer.json") in message
    for word in words:
        assert word in message


def test_stop_token_ids_are_resolved_in_the_bundles_vocabulary(tmp_path):
    """chatml's stop string <|im_end|> is id 2 in SmolLM2's vocabulary, not in another one: the bundle's
    tokenizer decides (with the model's eos ids first); without a tokenizer the eos ids, else the YAML's."""
    from tokenizers import AddedToken

    tok = _bpe()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True), AddedToken("<|im_end|>", special=True)])
    folder = _save(tmp_path, "qwenish", tok)
    table = token_table(json.loads((folder / "tokenizer.json").read_text()))
    im_end = table["<|im_end|>"]
    assert im_end not in (2, 7)
    assert bundle_conversation("chatml", folder, [7]).conv["stop_token_ids"] == [7, im_end]
    assert bundle_conversation("qwen2", folder, []).conv["stop_token_ids"] == [table["<|endoftext|>"], im_end]
    assert bundle_conversation("chatml", None, [5]).conv["stop_token_ids"] == [5]
    assert bundle_conversation("qwen2", None, []).conv["stop_token_ids"] == [151643, 151645]
    # no chat template in the folder: the YAML's system message stays
    assert bundle_conversation("qwen2", folder, []).conv["system_message"] == "You are a helpful assistant."


def test_chat_template_sources(tmp_path):
    assert chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert chat_template(tmp_path) == "D"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert chat_template(tmp_path) == "J"                  # the separate file wins, as in transformers


def test_unrenderable_chat_template_keeps_the_yaml(tmp_path):
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('no') }}")
    fitted = bundle_conversation("chatml", tmp_path, [2])
    assert fitted.conv["system_message"] == load_template("chatml")["system_message"]
    assert len(fitted.warnings) == 1 and "does not render here (no)" in fitted.warnings[0]
