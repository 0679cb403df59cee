"""Request -> the exact token ids llama-server will put in (and cache for) a slot.

Chat: render the GGUF's chat template the way llama-server does (`chat_request` builds
the context, `chat_template` renders it), then tokenize with `add_special` and
`parse_special` like the server (`tokenizer.FragmentTokenizer`, cached per fragment
between special tokens, so a turn whose history was seen costs little).

Completions (`/completion`, `/v1/completions`): `tokenize_input_prompts` semantics -- a
string is tokenized with BOS (if the vocabulary adds one) and special tokens parsed; a
list of ids is used as is; a mixed list tokenizes its strings, only the first one with
BOS. A list of several prompts makes several tasks on the server; the proxy routes by
the first.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from proxy.prompt.caps import TemplateCaps, probe_caps
from proxy.prompt.chat_request import ChatInputs, PromptError, ServerChatOptions, build_inputs
from proxy.prompt.delimiters import TokenizedDelimiters, server_delimiters, tokenize_delimiters
from proxy.prompt.handlers import (
    detect_handler,
    finish_prompt,
    patch_source,
    supports_thinking,
)
from proxy.prompt.media import (
    MARKER,
    MediaCounts,
    completion_media,
    expand,
    media_of,
    with_marker,
)
from proxy.prompt.template import CHATML_TEMPLATE_SRC, ChatTemplate, TemplateError
from proxy.prompt.tokenizer import FragmentTokenizer, Plan

__all__ = ["Plan", "PromptBuilder", "PromptError", "ServerChatOptions", "TemplateCaps"]


class PromptBuilder:
    """Exact prompt tokens for chat and completion requests against one GGUF."""

    def __init__(self, tokenizer: FragmentTokenizer, template: ChatTemplate,
                 tool_template: ChatTemplate | None = None, *,
                 options: ServerChatOptions | None = None,
                 caps: TemplateCaps | None = None,
                 tool_caps: TemplateCaps | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.tool_template = tool_template
        self.caps = caps or probe_caps(template)
        # the server's default: thinking on where the template supports it
        self.options = options or ServerChatOptions(
            enable_thinking=supports_thinking(template, self.caps))
        self.tool_caps = tool_caps or (probe_caps(tool_template) if tool_template else None)
        # The (role, int32 ids) the server finds user-message starts by
        # (proxy/prompt/delimiters.py), for the default template: a request with tools
        # renders with `tool_template` when there is one, whose delimiters may differ;
        # the default's stand for them.
        self.message_delimiters: TokenizedDelimiters = tokenize_delimiters(
            server_delimiters(template, self.caps), tokenizer)
        # the positions the backends' projector gives media (where not known, a
        # prompt's ids stop at its first media: proxy/prompt/media.py)
        self.media = MediaCounts()

    @classmethod
    def load(cls, gguf_path: Path, *, chat_template: str | None = None,
             options: ServerChatOptions | None = None,
             caps: Mapping[str, Any] | None = None,
             max_cached_tokens: int = 2_000_000) -> PromptBuilder:
        """Vocabulary (llama-cpp-python, vocab_only) and chat template of `gguf_path`.

        `chat_template` overrides the GGUF's (as `--chat-template-file` does); `caps` may
        be the backend's `/props` `chat_template_caps` (otherwise probed locally).
        """
        tok = FragmentTokenizer(gguf_path, max_cached_tokens=max_cached_tokens)
        md = tok.metadata
        default_src = chat_template or md.get("tokenizer.chat_template") or ""
        tool_src = None if chat_template else md.get("tokenizer.chat_template.tool_use")
        # common_chat_templates_init: an empty or "chatml" template means the tool_use
        # variant if there is one, else llama.cpp's built-in ChatML.
        if not default_src or default_src == "chatml":
            default_src = tool_src or CHATML_TEMPLATE_SRC
        default_src = patch_source(default_src)
        bos = tok.piece(tok.bos_id) if tok.bos_id >= 0 else ""
        eos = tok.piece(tok.eos_id) if tok.eos_id >= 0 else ""
        tmpl = ChatTemplate(default_src, bos, eos)
        tool_tmpl = ChatTemplate(tool_src, bos, eos) if tool_src else None
        parsed = TemplateCaps.from_props(caps) if caps is not None else None
        return cls(tok, tmpl, tool_tmpl, options=options, caps=parsed,
                   tool_caps=parsed if tool_tmpl else None)

    # -- chat ---------------------------------------------------------------------------

    def _template_for(self, body: Mapping[str, Any]) -> tuple[ChatTemplate, TemplateCaps]:
        tools = body.get("tools") if isinstance(body, Mapping) else None
        if self.tool_template is not None and isinstance(tools, list) and tools:
            return self.tool_template, self.tool_caps or self.caps
        return self.template, self.caps

    def render_chat(self, body: Mapping[str, Any]) -> str:
        """The prompt text `/apply-template` returns for `body`."""
        tmpl, caps = self._template_for(body)
        inputs = build_inputs(body, caps, tmpl.source, tmpl.bos_token, tmpl.eos_token,
                              self.options)
        try:
            prompt = finish_prompt(tmpl.source, self._apply(tmpl, inputs.context),
                                   bool(inputs.context.get("add_generation_prompt")))
            if inputs.continue_text is not None:
                prompt += self._generation_prompt(tmpl, inputs) + inputs.continue_text
        except TemplateError as e:
            status = 400 if detect_handler(tmpl.source) is None else 500
            raise PromptError(str(e), status) from e
        return prompt

    def _apply(self, tmpl: ChatTemplate, context: Mapping[str, Any]) -> str:
        out = tmpl.render(context)
        # common_chat_template_direct_apply_impl drops a BOS/EOS the template wrote when
        # the tokenizer adds them itself.
        tok = self.tokenizer
        if tok.add_bos and tmpl.bos_token and out.startswith(tmpl.bos_token):
            out = out[len(tmpl.bos_token):]
        if tok.add_eos and tmpl.eos_token and out.endswith(tmpl.eos_token):
            out = out[:-len(tmpl.eos_token)]
        return out

    def _generation_prompt(self, tmpl: ChatTemplate, inputs: ChatInputs) -> str:
        # common_chat_template_generation_prompt_impl: what add_generation_prompt adds.
        without = self._apply(tmpl, inputs.context)
        with_gen = self._apply(tmpl, {**inputs.context, "add_generation_prompt": True})
        n = 0
        limit = min(len(without), len(with_gen))
        while n < limit and without[n] == with_gen[n]:
            n += 1
        return with_gen[n:]

    def chat_tokens(self, body: Mapping[str, Any]) -> list[int]:
        """Token ids of the prompt llama-server builds for an OpenAI chat request."""
        return self.chat_ids(body).tolist()

    def chat_ids(self, body: Mapping[str, Any]) -> array:
        """`chat_tokens` as an `array('i')`: what the proxy routes with (the router takes
        it as a memcpy; a 30k-int list costs ~1 ms to build and as much to convert)."""
        plan = self.plan_chat(body)
        return self.finish(self.fetch(plan))

    # `chat_ids` in steps (FragmentTokenizer.plan/fetch/finish), for a caller that runs
    # only `fetch` -- llama_tokenize of text never seen -- on a worker thread.

    def plan_chat(self, body: Mapping[str, Any]) -> Plan:
        """Render `body` and look the prompt's fragments up in the cache."""
        plan = self.tokenizer.plan(self.render_chat(body), add_special=True)
        if plan.media:
            plan.images = media_of(body)
        return plan

    def fetch(self, plan: Plan) -> Plan:
        """Tokenize what `plan` misses (any thread); PromptError for invalid Unicode."""
        try:
            self.tokenizer.fetch(plan)
        except UnicodeEncodeError as e:
            raise PromptError(f"prompt text is not valid Unicode: {e.reason}") from e
        return plan

    def finish(self, plan: Plan) -> array:
        """The prompt's ids (on the thread that made `plan`), each media's chunk in place."""
        ids = self.tokenizer.finish(plan)
        return expand(ids, plan.images, self.media.chunk) if plan.media else ids

    def learn_media(self, body: Mapping[str, Any], reported: int,
                    markers: Iterable[str] = ()) -> array | None:
        """A server gave ``reported`` positions to ``body``'s prompt (a chat's, or a
        completion's first): learn the count of its one image size not known
        (`MediaCounts.learn`). The prompt's ids with that image in place, or None."""
        if not self.media.learns:
            return None
        if "messages" in body:
            plan = self.plan_chat(body)
        else:
            prompt = body.get("prompt")
            prompt = prompt[0] if isinstance(prompt, list) and prompt else prompt
            if not (isinstance(prompt, Mapping) and "multimodal_data" in prompt
                    and isinstance(prompt.get("prompt_string"), str)):
                return None
            plan = self._media_plan(prompt, markers)
        if not plan.media:
            return None
        ids = self.tokenizer.finish(self.fetch(plan))
        if not self.media.learn(ids, plan.images, reported):
            return None
        return expand(ids, plan.images, self.media.chunk)

    def forget_media(self, body: Mapping[str, Any]) -> None:
        """A server counted ``body``'s prompt (a chat's) otherwise than its ids, whole:
        forget the learned counts of its images (`MediaCounts.forget`)."""
        if self.media.learns and "messages" in body:
            self.media.forget(media_of(body))

    def head(self, plan: Plan) -> tuple[array, int] | None:
        """The ids of the prompt before its first text no cache holds, and that text's
        offset (see FragmentTokenizer.head); None when `plan` has no fast path."""
        return None if plan.pieces is None else self.tokenizer.head(plan)

    # -- completions --------------------------------------------------------------------

    def completion_tokens(self, prompt: object) -> list[int]:
        """Token ids for a `/completion` or `/v1/completions` `prompt` (the first prompt of
        a batch)."""
        return self.completion_ids(prompt).tolist()

    def completion_ids(self, prompt: object, markers: Iterable[str] = ()) -> array:
        """`completion_tokens` as an `array('i')` (see `chat_ids`). ``markers``: the
        backends' media markers, which a subprompt with `multimodal_data` holds."""
        if isinstance(prompt, list) and not _contains_int(prompt):
            if not prompt:
                raise PromptError('"prompt" must not be empty')
            prompt = prompt[0]  # several prompts: one task each; route by the first
        if isinstance(prompt, Mapping) and "multimodal_data" in prompt \
                and isinstance(prompt.get("prompt_string"), str):
            return self.finish(self.fetch(self._media_plan(prompt, markers)))
        return self._subprompt(prompt)

    def _media_plan(self, prompt: Mapping[str, Any], markers: Iterable[str]) -> Plan:
        """The plan of a subprompt with media (process_mtmd_prompt: the text between
        markers tokenized part by part, BOS first)."""
        plan = self.tokenizer.plan(with_marker(prompt["prompt_string"], markers, MARKER),
                                   add_special=True)
        plan.images = completion_media(prompt)
        return plan

    def _subprompt(self, prompt: object) -> array:
        if isinstance(prompt, str):
            return self._tokenize(prompt, add_special=True)
        if isinstance(prompt, list) and _contains_int(prompt) and all(
                _is_int(x) or isinstance(x, str) for x in prompt):
            out = array("i")
            for i, part in enumerate(prompt):
                if isinstance(part, str):
                    out.extend(self._tokenize(part, add_special=(i == 0)))
                else:
                    out.append(self._token_id(part))
            return out
        if isinstance(prompt, Mapping) and "prompt_string" in prompt:
            return self._subprompt(prompt["prompt_string"])
        raise PromptError('"prompt" elements must be a string, a list of tokens, a JSON '
                          "object containing a prompt string, or a list of mixed strings & "
                          "tokens.")

    def _token_id(self, x: int) -> int:
        if not 0 <= x < self.tokenizer.n_vocab:
            raise PromptError(f"token id {x} is out of range [0, {self.tokenizer.n_vocab})")
        return x

    def _tokenize(self, text: str, add_special: bool) -> array:
        try:
            return self.tokenizer.tokenize_ids(text, add_special=add_special)
        except UnicodeEncodeError as e:
            raise PromptError(f"prompt text is not valid Unicode: {e.reason}") from e


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _contains_int(xs: list[Any]) -> bool:
    return any(_is_int(x) for x in xs)
