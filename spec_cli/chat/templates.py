"""Chat templates: how a conversation becomes the prompt text and token ids (plain transcript or Jinja)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from spec_cli.core.errors import SpecError
from spec_cli.core.settings import Profile

PLAIN = "plain"
USER, ASSISTANT = "User", "Assistant"
PLAIN_STOP = f"\n{USER}:"  # the model starting the next user turn ends its reply (plain transcripts)


@dataclass(frozen=True)
class Template:
    """How a conversation becomes a prompt: the built-in plain transcript or a Jinja chat template."""

    label: str  # shown in the header and /show: "plain", "profile", "tokenizer" or a file path
    jinja: str | None = None  # None with label "tokenizer": the tokenizer's own template

    @property
    def plain(self) -> bool:
        return self.label == PLAIN

    @property
    def stop(self) -> str | None:
        return PLAIN_STOP if self.plain else None


def read_template_option(value: str | None) -> Template | None:
    """--template: `plain` or the path of a Jinja file."""
    if value is None:
        return None
    if value == PLAIN:
        return Template(PLAIN)
    path = Path(value).expanduser()
    if not path.is_file():
        raise SpecError(f"--template must be 'plain' or a Jinja chat template file; file not found: {value}")
    try:
        return Template(str(path), path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"cannot read chat template {value}: {e}") from None


def choose_template(profile: Profile, tokenizer, option: Template | None = None) -> Template:
    """--template, else the profile's chat_template, else the tokenizer's own, else plain."""
    if option is not None:
        template = option
    elif profile.chat_template:
        template = Template(PLAIN) if profile.chat_template == PLAIN else Template("profile", profile.chat_template)
    elif getattr(tokenizer, "chat_template", None):
        template = Template("tokenizer")
    else:
        template = Template(PLAIN)
    if not template.plain:  # a broken template is one clear error now, not at the first message
        render(tokenizer, template, "You are helpful.", [{"role": "user", "content": "Hi"}])
    return template


def source(tokenizer, template: Template) -> str:
    """The template's Jinja text ("" for the plain transcript); a tokenizer's named templates all together
    (transformers picks "tool_use" when tools are given)."""
    text = template.jinja if template.jinja is not None else getattr(tokenizer, "chat_template", None)
    if template.plain or not text:
        return ""
    return " ".join(text.values()) if isinstance(text, dict) else str(text)


def takes_tools(tokenizer, template: Template) -> bool:
    """Whether the template writes a request's tools (and the calls and results of tool messages) into the prompt."""
    return "tools" in source(tokenizer, template)


def render(tokenizer, template: Template, system: str | None, messages: list[dict],
           tools: list[dict] | None = None, variables: dict | None = None) -> str:
    """The conversation as the prompt text, ending where the assistant's next reply begins; `tools` (OpenAI's
    function entries) written where the template writes them; `variables`: more for the template
    (`enable_thinking`, ...)."""
    if template.plain:
        parts = [system.strip() + "\n\n"] if system and system.strip() else []
        for m in messages:
            if m["role"] == "user":
                parts.append(f"{USER}: {m['content']}\n")
            else:
                parts.append(f"{ASSISTANT}: {m['content']}\n\n")
        return "".join(parts) + f"{ASSISTANT}:"
    conversation = ([{"role": "system", "content": system}] if system else []) + list(messages)
    try:
        return tokenizer.apply_chat_template(conversation, tools=tools or None, tokenize=False,
                                             add_generation_prompt=True, chat_template=template.jinja,
                                             **(variables or {}))
    except Exception as e:  # noqa: BLE001 - Jinja errors, raise_exception() in templates, ...
        raise SpecError(f"chat template ({template.label}): {type(e).__name__}: {e}") from None


def prompt_ids(tokenizer, template: Template, system: str | None, messages: list[dict],
               tools: list[dict] | None = None, variables: dict | None = None) -> list[int]:
    """Token ids of the rendered conversation. A Jinja template writes its own special tokens (BOS and
    the like), so they are not added again; the plain transcript is tokenized like `spec generate`'s prompt."""
    text = render(tokenizer, template, system, messages, tools, variables)
    ids = tokenizer(text, add_special_tokens=template.plain)["input_ids"]
    if not ids:
        bos = tokenizer.bos_token_id
        if bos is None:
            raise SpecError("the conversation renders to nothing and the tokenizer has no BOS token")
        ids = [bos]
    return ids
