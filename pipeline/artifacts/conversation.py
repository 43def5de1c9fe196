"""The conversation template MLC-LLM's engine builds prompts from (mlc-chat-config.json's `conv_template`).

MLC's engine (mlc4j, MLCSwift, libmlc_llm at mlc-ai/mlc-llm@79d603f0) does not run the tokenizer's jinja chat
template: it parses a `Conversation` object from the chat config (`Conversation::FromJSON`,
cpp/json_ffi/conv_template.cc) and concatenates strings by fixed rules (`CreatePrompt`). So a bundle must carry
a Conversation that gives, for every conversation, the text the model was trained on, which is what
`python -m pipeline run` feeds (the tokenizer's `apply_chat_template(..., add_generation_prompt=True)`).

- Templates are data: configs/conv_templates/<name>.yaml, every field of MLC's Conversation (`load_template`).
- `render_prompt` is the engine's prompt assembly, restated from conv_template.cc's rules.
- `render_chat_template` renders a tokenizer's own jinja template the way transformers does.
- `bundle_conversation` fits a template to a bundle's tokenizer: the model's default system message taken from
  its chat template, stop token ids resolved in its vocabulary, and a check that the engine's prompt equals the
  chat template's on a few probe conversations (mismatches come back as warnings).

See docs/conversation-templates.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from pipeline.artifacts.tokenizer_info import read_tokenizer_json, token_table
from pipeline.config import CONFIGS
from pipeline.errors import ConfigError, WeightsError

TEMPLATE_DIR = CONFIGS / "conv_templates"
# The placeholders conv_template.cc replaces (its PLACEHOLDERS / MessagePlaceholderFromString).
PLACEHOLDERS = {"system": "{system_message}", "user": "{user_message}", "assistant": "{assistant_message}",
                "tool": "{tool_message}", "function": "{function_string}"}
DEFAULT_ROLE_TEMPLATES = {"user": "{user_message}", "assistant": "{assistant_message}", "tool": "{tool_message}"}


def _str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _int_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)


def _str_map(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items())


def _messages(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(m, list) and len(m) == 2 and isinstance(m[0], str)
                                       and (m[1] is None or isinstance(m[1], str)) for m in v)


# field -> (required by Conversation::FromJSON, type check, what to write). The required ones are those the
# engine looks up without a default (a chat config lacking one does not load); the rest are optional there.
# function_string / use_function_calling are MLC's Python-side fields, written by gen_config and ignored by
# the engine; they are kept so a bundle's conv_template has the same keys as MLC's own.
FIELDS: dict[str, tuple[bool, Callable[[Any], bool], str]] = {
    "name": (False, lambda v: v is None or isinstance(v, str), "a string"),
    "system_template": (True, lambda v: isinstance(v, str), "a string"),
    "system_message": (True, lambda v: isinstance(v, str), "a string"),
    "system_prefix_token_ids": (False, lambda v: v is None or _int_list(v), "null or a list of token ids"),
    "add_role_after_system_message": (True, lambda v: isinstance(v, bool), "true or false"),
    "roles": (True, _str_map, "a mapping of role -> string"),
    "role_templates": (False, _str_map, "a mapping of role -> string"),
    "messages": (True, _messages, "a list of [role, content] pairs"),
    "seps": (True, lambda v: _str_list(v) and 1 <= len(v) <= 2, "a list of 1 or 2 strings"),
    "role_content_sep": (True, lambda v: isinstance(v, str), "a string"),
    "role_empty_sep": (True, lambda v: isinstance(v, str), "a string"),
    "stop_str": (True, _str_list, "a list of strings"),
    "stop_token_ids": (True, _int_list, "a list of token ids"),
    "strip_reasoning_in_history": (False, lambda v: isinstance(v, bool), "true or false"),
    "function_string": (False, lambda v: isinstance(v, str), "a string"),
    "use_function_calling": (False, lambda v: isinstance(v, bool), "true or false"),
}
DEFAULTS = {"system_prefix_token_ids": None, "role_templates": {}, "strip_reasoning_in_history": False,
            "function_string": "", "use_function_calling": False}


# --------------------------------------------------------------------------------------- templates as data
def known_templates() -> dict[str, Path]:
    return {p.stem: p for p in sorted(TEMPLATE_DIR.glob("*.yaml"))}


def template_path(name: str, *, model_file: Path | None = None) -> Path:
    """configs/conv_templates/<name>.yaml; an unknown name is one line naming the model config that asked for it."""
    known = known_templates()
    if name not in known:
        raise ConfigError(f"unknown conv_template {name!r}", path=model_file,
                          fix=f"use one of: {', '.join(known) or '(none)'} (or add configs/conv_templates/{name}.yaml)")
    return known[name]


def template_digest(name: str) -> str | None:
    """The template file's sha256 (for build keys: an edited template rebuilds the chat config); None if unknown."""
    path = known_templates().get(name)
    return hashlib.sha256(path.read_bytes()).hexdigest()[:20] if path else None


def load_template(name: str, *, model_file: Path | None = None) -> dict[str, Any]:
    """A conversation template as the JSON object MLC's engine parses: checked field by field, defaults filled
    (role_templates merged over the user / assistant / tool defaults, as MLC does)."""
    path = template_path(name, model_file=model_file)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ConfigError(f"not valid YAML ({str(err).splitlines()[0]})", path=path, fix="fix the YAML syntax") from None
    if not isinstance(data, dict):
        raise ConfigError("expected a mapping of conversation template fields", path=path,
                          fix="compare with configs/conv_templates/chatml.yaml")
    return check_template({"name": name, **data}, path)


def check_template(data: dict[str, Any], path: Path | str = "conv_template") -> dict[str, Any]:
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ConfigError(f"unknown field(s) {', '.join(map(str, unknown))}", path=path,
                          fix=f"use only MLC's Conversation fields: {', '.join(FIELDS)}")
    missing = [f for f, (required, _, _) in FIELDS.items() if required and f not in data]
    if missing:
        raise ConfigError(f"missing field(s) {', '.join(missing)} (MLC's engine requires them)", path=path,
                          fix="compare with configs/conv_templates/chatml.yaml")
    conv = {**DEFAULTS, **data}
    for f, (_, ok, what) in FIELDS.items():
        if not ok(conv[f]):
            raise ConfigError(f"{f} must be {what}, not {conv[f]!r}", path=path,
                              fix="compare with configs/conv_templates/chatml.yaml")
    conv["role_templates"] = {**DEFAULT_ROLE_TEMPLATES, **conv["role_templates"]}
    for role in ("user", "assistant"):
        if role not in conv["roles"]:
            raise ConfigError(f"roles has no {role!r} (the engine needs user and assistant)", path=path,
                              fix=f"add roles: {{{role}: ...}}")
    for role in conv["roles"]:
        if role not in PLACEHOLDERS or role == "function" or role not in conv["role_templates"]:
            raise ConfigError(f"role {role!r} has no role template the engine can fill", path=path,
                              fix="use the roles user, assistant, tool (or add role_templates for system / tool)")
    if conv["name"] is None:
        del conv["name"]
    return {f: conv[f] for f in FIELDS if f in conv}


def to_json(conv: dict[str, Any]) -> dict[str, Any]:
    """The conv_template object of mlc-chat-config.json (unset optional fields left out, as MLC writes it)."""
    return {k: v for k, v in conv.items() if v is not None}


# --------------------------------------------------------------------------------- the engine's prompt
def render_prompt(conv: dict[str, Any], messages: Sequence[dict[str, Any]]) -> tuple[list[int], str]:
    """(token ids the engine puts first, prompt text) for `messages` ({"role", "content"} dicts), by the rules
    of MLC's `CreatePrompt`: system messages (the template's, then the request's) are concatenated into the
    system template, or the template's system_message when there are none; then every other message as
    role + role_content_sep + role template + separator (seps[1] after the assistant when there are two);
    then the assistant role + role_empty_sep. Placeholders are replaced once (the first occurrence)."""
    history = [(m[0], m[1]) for m in conv["messages"]]
    request = [(m["role"], m.get("content")) for m in messages]
    if conv.get("strip_reasoning_in_history"):
        history, request = _strip_reasoning(history, request)
    system = [c for r, c in history + request if r == "system"]
    if any(not isinstance(c, str) for c in system):
        raise ValueError("a system message must be text")
    text = _fill(conv["system_template"], PLACEHOLDERS["system"], "".join(system) if system else conv["system_message"])
    count = 0
    for role, content in [*history, *request, ("assistant", None)]:
        if role == "system":
            continue
        if role not in conv["roles"]:
            raise ValueError(f'Role "{role}" is not supported')
        name = conv["roles"][role]
        if content is None:
            text += name + conv["role_empty_sep"]
            continue
        if not isinstance(content, str):
            raise ValueError("only text content is rendered here")
        count += 1
        seps = conv["seps"]
        sep = seps[(1 if role == "assistant" else 0) % len(seps)]
        if conv["add_role_after_system_message"] or not text or count != 1:
            text += name + conv["role_content_sep"]
        if role not in PLACEHOLDERS or role not in conv["role_templates"]:
            raise ValueError(f'Role "{role}" has no role template')
        text += _fill(conv["role_templates"][role], PLACEHOLDERS[role], content) + sep
    return list(conv.get("system_prefix_token_ids") or []), text


def _fill(template: str, placeholder: str, value: str) -> str:
    return template.replace(placeholder, value, 1)


def _strip_reasoning(history: list[tuple], request: list[tuple]) -> tuple[list[tuple], list[tuple]]:
    """strip_reasoning_in_history: assistant turns before the last user turn keep only what follows their
    last `</think>` (newlines right after it dropped)."""
    both = history + request
    last_user = max((i for i, (r, _) in enumerate(both) if r == "user"), default=-1)
    out = []
    for i, (role, content) in enumerate(both):
        if role == "assistant" and i < last_user and isinstance(content, str) and "</think>" in content:
            content = content[content.rindex("</think>") + len("</think>"):].lstrip("\n")
        out.append((role, content))
    return out[:len(history)], out[len(history):]


# ------------------------------------------------------------------------ the tokenizer's chat template
def chat_template(folder: Path) -> str | None:
    """The tokenizer's jinja chat template: chat_template.jinja, else tokenizer_config.json's `chat_template`
    (a string, or the entry named "default" of a list), as transformers loads it; None when there is none."""
    folder = Path(folder)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = _tokenizer_config(folder).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _tokenizer_config(folder: Path) -> dict[str, Any]:
    return _json_object(Path(folder) / "tokenizer_config.json")


def _json_object(path: Path) -> dict[str, Any]:
    """A tokenizer's JSON side file as a dict ({} when absent); unreadable is a one-line error naming it."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WeightsError(f"cannot read it ({str(err).splitlines()[0][:200]})", path=path,
                           fix=f"copy {path.name} again from the model's HF repo") from None
    return data if isinstance(data, dict) else {}


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def special_tokens(folder: Path) -> dict[str, str]:
    """bos_token, eos_token, ... as a chat template sees them (transformers passes its special tokens map):
    from special_tokens_map.json, overridden by tokenizer_config.json."""
    found: dict[str, str] = {}
    for data in (_json_object(Path(folder) / "special_tokens_map.json"), _tokenizer_config(folder)):
        for key in SPECIAL_TOKENS:
            value = data.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                found[key] = value
    return found


def render_chat_template(template: str, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
                         **tokens: str) -> str:
    """The jinja template rendered as transformers' apply_chat_template does (sandboxed, trim_blocks,
    lstrip_blocks, loop controls, tojson without HTML escaping, raise_exception, strftime_now)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):       # {% generation %}...{% endgeneration %}: rendered as is
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(template).render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                            add_generation_prompt=add_generation_prompt, **tokens)


# ----------------------------------------------------------------------------------- fit to a bundle
PROBE_USER = "Hello! What can you do?"
PROBES: dict[str, list[dict[str, str]]] = {
    "user": [{"role": "user", "content": PROBE_USER}],
    "system,user": [{"role": "system", "content": "You are a pirate. Answer in one sentence."},
                    {"role": "user", "content": PROBE_USER}],
    "user,assistant,user": [{"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": "Hello! How can I help you today?"},
                            {"role": "user", "content": "Tell me a joke."}],
}


@dataclasses.dataclass
class Fitted:
    """A template fitted to a bundle's tokenizer, and what could not be made to match."""

    conv: dict[str, Any]
    warnings: list[str] = dataclasses.field(default_factory=list)


def bundle_conversation(name: str, folder: Path | None, eos_token_ids: Sequence[int] = (), *,
                        model_file: Path | None = None) -> Fitted:
    """The conv_template for a bundle whose tokenizer files are in `folder` (None: no tokenizer).

    - stop_token_ids: the model's eos ids plus every stop_str that is one token of the bundle's tokenizer (the
      template's own ids belong to the vocabulary it was written for); with no tokenizer, the eos ids, else the
      template's.
    - system_message: the one the tokenizer's chat template renders when the conversation has none (e.g.
      SmolLM2's "You are a helpful AI assistant named SmolLM, trained by Hugging Face").
    - the engine's prompt (`render_prompt`) is compared with the chat template's for PROBES; each mismatch is a
      warning naming the probe and the first differing text."""
    conv = load_template(name, model_file=model_file)
    fitted = Fitted(conv)
    eos = [int(i) for i in eos_token_ids]
    table: dict[str, int] = {}
    if folder is not None and (Path(folder) / "tokenizer.json").is_file():
        table = token_table(read_tokenizer_json(Path(folder) / "tokenizer.json"))
    if table:
        stops = [table[s] for s in conv["stop_str"] if s in table]
        conv["stop_token_ids"] = list(dict.fromkeys([*eos, *stops]))
    elif eos:
        conv["stop_token_ids"] = list(dict.fromkeys(eos))
    template = chat_template(folder) if folder is not None else None
    if template is None:
        return fitted
    tokens = special_tokens(folder)
    try:
        def hf(messages):
            return render_chat_template(template, messages, **tokens)

        message = default_system_message(conv, hf(PROBES["user"]), table)
    except Exception as err:   # a template this renderer cannot run: keep the YAML's, say so
        fitted.warnings.append(f"the tokenizer's chat template does not render here ({_one_line(err)}); "
                               f"conv_template {name} is used as written")
        return fitted
    if message is None:
        fitted.warnings.append(f"the tokenizer's chat template renders no default system turn that conv_template "
                               f"{name} can hold; its system_message is used as written")
    else:
        conv["system_message"] = message
    for probe, messages in PROBES.items():
        want = hf(messages)
        got = engine_text(conv, messages, table)
        if got != want:
            fitted.warnings.append(f"conv_template {name} gives another prompt than the tokenizer's chat template "
                                   f"for [{probe}]: {first_difference(got, want)}")
    return fitted


def engine_text(conv: dict[str, Any], messages: Sequence[dict[str, Any]], table: dict[str, int]) -> str:
    """The engine's prompt as text: its prefix token ids written as their token strings, then the prompt."""
    prefix, text = render_prompt(conv, messages)
    return _token_text(prefix, table) + text


def _token_text(ids: Sequence[int], table: dict[str, int]) -> str:
    names = {i: s for s, i in table.items()} if ids else {}
    return "".join(names.get(i, f"<token {i}>") for i in ids)


def default_system_message(conv: dict[str, Any], rendered: str, table: dict[str, int]) -> str | None:
    """The system message in `rendered` (the chat template's text for PROBES["user"]): what is left between the
    prefix tokens and the engine's rendering of the same turns without a system text, if that is the
    template's system_template around a message. None when the shapes do not line up (e.g. a chat template
    with no default system turn, which MLC's engine cannot express: it always renders the system template)."""
    if not conv["add_role_after_system_message"] or PLACEHOLDERS["system"] not in conv["system_template"]:
        return None
    prefix = _token_text(conv.get("system_prefix_token_ids") or [], table)
    _, tail = render_prompt({**conv, "system_template": "", "system_prefix_token_ids": None}, PROBES["user"])
    if len(rendered) < len(prefix) + len(tail) or not rendered.startswith(prefix) or not rendered.endswith(tail):
        return None
    head = rendered[len(prefix):len(rendered) - len(tail)]
    before, _, after = conv["system_template"].partition(PLACEHOLDERS["system"])
    if not head or len(head) < len(before) + len(after) or not head.startswith(before) or not head.endswith(after):
        return None
    return head[len(before):len(head) - len(after)]


def first_difference(got: str, want: str) -> str:
    """Where two prompts part, in a few characters of each (repr'd, so newlines show)."""
    i = next((k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    return f"at character {i} the engine has {got[i:i + 40]!r}, the chat template {want[i:i + 40]!r}"


def _one_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
