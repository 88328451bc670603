r"""Rendering conversations with the target's own chat template, and the loss mask.

The mask is 1 on exactly the tokens the target *generates* in each assistant turn: the
assistant content and the end-of-turn token that closes it (`<|im_end|>`, `<|eot_id|>`), in
every assistant turn, and nothing of system or user turns or of the template's scaffolding.

How the assistant spans are found, for any template and without template-specific code:

1. Render the conversation as the model sees it (`apply_chat_template`, no generation prompt).
2. Render it again with every assistant content replaced by a unique marker. Between the
   markers lies pure scaffolding (plus user and system turns, which are identical in both
   renderings). Each piece must reappear, in order, in the real rendering; what lies between
   two pieces is the assistant content as the template rendered it (Llama-3 trims it; Qwen3
   moves `<think>...</think>` out of it). Every piece after a turn starts with the template's
   end-of-turn special token, so content cannot be mistaken for scaffolding; content that
   itself contains special-token text cannot be rendered faithfully and is refused.
3. What the model generates starts right after the generation prompt (`add_generation_prompt`
   for the same mode; for templates without one, right after the last special token before
   the content). Qwen3 in thinking mode has the prompt `<|im_start|>assistant\n`, so
   the `<think>\n\n</think>\n\n` the template writes into the last turn is generated text and
   is masked; with `--no-thinking` the prompt already ends with that block and it is not.
4. Tokenize the real rendering once (exactly what `apply_chat_template(tokenize=True)`
   gives) and mask every token that starts inside a generated span.
"""

from __future__ import annotations

import bisect
import functools
import re
from collections.abc import Sequence
from typing import Any

from eagle3kit.errors import InputError

# Private-use code points: never produced by the templates, and checked absent from the data.
_MARK = "\ue000{}\ue001"
_MARK_RE = re.compile("\ue000(\\d+)\ue001")
_REWRITES = "the chat template rewrites the conversation"


class RenderError(InputError):
    """This conversation cannot be rendered with a faithful loss mask; `reason` is a short
    phrase for counting (tokenize drops such conversations and reports the counts)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def _as_dicts(messages: Sequence[Any]) -> list[dict[str, str]]:
    out = []
    for m in messages:
        if isinstance(m, dict):
            out.append({"role": m["role"], "content": m["content"]})
        else:
            out.append({"role": m.role, "content": m.content})
    return out


class Renderer:
    """A tokenizer plus a chat template and thinking mode, analysed once.

    `thinking` None leaves the template's default (Qwen3: thinking); True/False passes
    `enable_thinking` to the template.
    """

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None,
                 thinking: bool | None = None):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise InputError("eagle3kit needs a fast (Rust) tokenizer with offsets; this one "
                             f"is {type(tokenizer).__name__}")
        self.backend = backend
        self.template = chat_template if chat_template is not None else tokenizer.chat_template
        if not self.template:
            raise InputError("the tokenizer has no chat template; pass --chat-template FILE")
        self.kwargs = {} if thinking is None else {"enable_thinking": thinking}
        special = {str(t) for t in tokenizer.all_special_tokens}
        special |= {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
        special.discard("")
        if not special:
            raise InputError("the tokenizer has no special tokens; eagle3kit needs one to "
                             "end each assistant turn")
        # longest first, so `<|im_end|>` never matches as a shorter token's prefix
        self.special_re = re.compile("|".join(re.escape(s) for s in
                                              sorted(special, key=len, reverse=True)))
        self.generation_prompt = self._generation_prompt()

    def text(self, messages: Sequence[Any], *, add_generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                _as_dicts(messages), chat_template=self.template, tokenize=False,
                add_generation_prompt=add_generation_prompt, **self.kwargs)
        except Exception as e:  # jinja2 TemplateError, raise_exception(...) of the template
            raise RenderError("the chat template refuses it", str(e)) from None

    def has_thinking_switch(self) -> bool:
        """Whether the template reads `enable_thinking` (Qwen3's does; SmolLM2's, Llama's,
        Gemma's do not): a generation prompt or an answered turn renders differently with it
        on and off."""
        probes = [([{"role": "user", "content": "hi"}], True),
                  ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
                   False)]
        for messages, prompt in probes:
            try:
                on, off = (self.tokenizer.apply_chat_template(
                    messages, chat_template=self.template, tokenize=False,
                    add_generation_prompt=prompt, enable_thinking=mode) for mode in (True, False))
            except Exception as e:  # as `text`: the template's own errors
                raise RenderError("the chat template refuses it", str(e)) from None
            if on != off:
                return True
        return False

    def _generation_prompt(self) -> str | None:
        """The text `add_generation_prompt` appends after a user turn, or None when the
        template adds none (Mistral-style)."""
        probe = [{"role": "user", "content": "hi"}]
        with_prompt = self.text(probe, add_generation_prompt=True)
        without = self.text(probe)
        if not with_prompt.startswith(without) or with_prompt == without:
            return None
        return with_prompt[len(without):]

    def encode(self, text: str):
        return self.backend.encode(text, add_special_tokens=False)

    def spans(self, messages: Sequence[Any]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans [start, end) the model generates."""
        msgs = _as_dicts(messages)
        for m in msgs:
            if "\ue000" in m["content"] or "\ue001" in m["content"]:
                raise RenderError("private-use characters in content", "U+E000/U+E001 mark turns")
            hit = self.special_re.search(m["content"])
            if hit:
                raise RenderError("special-token text in content", f"a {m['role']} message "
                                  f"contains {hit.group()!r}, which would become a control "
                                  "token")
        text = self.text(msgs)
        marked = [dict(m) for m in msgs]
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        for k, i in enumerate(turns):
            marked[i]["content"] = _keep_reasoning(msgs[i]["content"]) + _MARK.format(k)
        skeleton = self.text(marked)
        pieces = _MARK_RE.split(skeleton)
        # split gives [piece, k, piece, k, ..., piece]: markers must appear once each, in order
        if [int(x) for x in pieces[1::2]] != list(range(len(turns))):
            raise RenderError(_REWRITES, "assistant turns dropped or repeated")
        scaffold = pieces[0::2]
        if not text.startswith(scaffold[0]):
            raise RenderError(_REWRITES, "the start depends on the assistant content")
        spans = []
        pos = len(scaffold[0])
        for k, piece in enumerate(scaffold[1:]):
            end = len(text) - len(piece) if k == len(turns) - 1 else text.find(piece, pos)
            if end < pos or (k == len(turns) - 1 and not text.endswith(piece)):
                raise RenderError(_REWRITES, f"assistant turn {k + 1} not found")
            content = msgs[turns[k]]["content"].strip()
            if not content.endswith(text[pos:end].strip()):
                raise RenderError(_REWRITES, f"assistant turn {k + 1} is not its content")
            start = self._generated_start(scaffold[k], pos)
            eot = self.special_re.search(piece)
            if eot is None:
                raise RenderError("no end-of-turn token", "the template closes an assistant "
                                  "turn without a special token")
            spans.append((start, end + eot.end()))
            pos = end + len(piece)
        return text, spans

    def _generated_start(self, before: str, content_start: int) -> int:
        """Where generation starts: after the generation prompt if it ends the scaffolding
        before the content (anything between, like Qwen3's think block, is generated).
        Without a generation prompt (Mistral-style), after the last special token before
        the content: the separator the template writes there is the model's to generate."""
        if self.generation_prompt:
            at = before.rfind(self.generation_prompt)
            cut = at + len(self.generation_prompt) if at >= 0 else len(before)
        else:
            ends = [m.end() for m in self.special_re.finditer(before)]
            cut = ends[-1] if ends else len(before)
        return content_start - (len(before) - cut)

    def render(self, messages: Sequence[Any]) -> tuple[list[int], list[int]]:
        """input_ids [T] and loss_mask [T] (0/1) of a whole conversation."""
        text, spans = self.spans(messages)
        enc = self.encode(text)
        return list(enc.ids), mask_from_spans(enc.offsets, spans)

    def prompt_ids(self, messages: Sequence[Any], *, add_generation_prompt: bool = True
                   ) -> list[int]:
        """Token ids of a prompt, ending with the generation prompt (for decoding)."""
        text = self.text(messages, add_generation_prompt=add_generation_prompt)
        return list(self.encode(text).ids)


def _keep_reasoning(content: str) -> str:
    """The `<think>...</think>` part of an assistant content, which templates like Qwen3 move
    out of the content: kept in the skeleton so both renderings move it the same way."""
    at = content.rfind("</think>")
    return content[:at + len("</think>")] if at >= 0 else ""


def mask_from_spans(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
                    ) -> list[int]:
    """1 for each token whose first character lies in a span (spans sorted, disjoint).

    A token that straddles the start of a span (scaffolding `\\n` merged with a leading space
    of the content) belongs to the prompt: at inference the prompt is tokenized on its own.
    """
    starts = [s for s, _ in offsets]  # non-decreasing along the sequence
    mask = [0] * len(starts)
    for begin, end in spans:
        lo, hi = bisect.bisect_left(starts, begin), bisect.bisect_left(starts, end)
        mask[lo:hi] = [1] * (hi - lo)
    return mask


def _renderer(tokenizer: Any, chat_template: str | None, thinking: bool | None) -> Renderer:
    # keyed by the template in effect, so a later change of tokenizer.chat_template is seen
    template = chat_template if chat_template is not None else tokenizer.chat_template
    return _cached_renderer(tokenizer, template, thinking)


@functools.lru_cache(maxsize=8)
def _cached_renderer(tokenizer: Any, template: str | None, thinking: bool | None) -> Renderer:
    return Renderer(tokenizer, chat_template=template, thinking=thinking)


def render(tokenizer: Any, messages: Sequence[Any], *, chat_template: str | None = None,
           thinking: bool | None = None) -> tuple[list[int], list[int]]:
    """input_ids [T] and loss_mask [T] of `messages` ([{"role", "content"}] or `Message`s).

    Raises `RenderError` (an `InputError`) when the conversation cannot be rendered with a
    faithful mask (the template refuses it, or its content contains special-token text).
    """
    return _renderer(tokenizer, chat_template, thinking).render(messages)


def prompt_ids(tokenizer: Any, messages: Sequence[Any], *, add_generation_prompt: bool = True,
               chat_template: str | None = None, thinking: bool | None = None) -> list[int]:
    """Token ids of `messages` rendered as a prompt (with the generation prompt by default)."""
    return _renderer(tokenizer, chat_template, thinking).prompt_ids(
        messages, add_generation_prompt=add_generation_prompt)
