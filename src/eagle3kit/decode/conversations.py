"""Multi-turn generation: which turns a conversation asks the target to answer, and in what
context, and the loop that answers them (`drive`): one implementation for `regenerate` (the
local engine or a server, --endpoint); `eval --prompts` walks the same dialogues a turn at a
time (jobs/evaluate.generate_samples: each answer timed alone).

A `Dialogue` walks a conversation's assistant turns in order. The prompt of turn j is the
conversation up to that turn's user message, rendered with the target's chat template, with
the *generated* answers of turns 1..j-1 in place of the originals: later turns see what the
target itself said, as in serving and as MT-bench is meant to be run.

Which assistant messages are answered (`plan`): one that follows a user message. Assistant
messages with no user message before them (a greeting that opens the chat, two assistant
messages in a row) have nothing to answer and are dropped, and so are user messages after the
last answered turn; system and user messages are kept where they stand.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from eagle3kit.data.records import Message

NO_USER_TURN = "no user turn to answer"
TOO_LONG = "prompt longer than --max-context"


@dataclasses.dataclass(frozen=True)
class Turn:
    """What generating one answer gave."""

    text: str
    prompt_tokens: int
    new_tokens: int
    finish_reason: str  # "stop" | "length" | "repetition" (regenerate's engine)


def plan(messages: Sequence[Message], first_only: bool = False
         ) -> tuple[list[Message], list[int]]:
    """(kept messages, indices of the assistant messages to generate) — see the module doc."""
    kept: list[Message] = []
    answer_at: list[int] = []
    for m in messages:
        if m.role == "assistant":
            if not kept or kept[-1].role != "user":
                continue
            answer_at.append(len(kept))
            kept.append(m)
            if first_only:
                break
        else:
            kept.append(m)
    if not answer_at:
        return kept, []
    return kept[: answer_at[-1] + 1], answer_at


class Dialogue:
    """One conversation being answered turn by turn.

    `prompt()` gives the messages the next answer responds to (None when every planned turn
    is answered); `answer(turn)` records it. `messages()` is the conversation with the
    answers given so far, cut after the last answered turn.
    """

    def __init__(self, messages: Sequence[Message], first_only: bool = False):
        self.kept, self.answer_at = plan(messages, first_only)
        self.turns: list[Turn] = []
        self.stop_reason: str | None = None  # why it ended before its last planned turn

    @classmethod
    def from_user_turns(cls, turns: Sequence[str], system: str | None = None) -> Dialogue:
        """A prompt set's conversation: every user message gets an answer."""
        msgs = [Message("system", system)] if system else []
        for t in turns:
            msgs += [Message("user", t), Message("assistant", "")]
        return cls(msgs)

    @property
    def finished(self) -> bool:
        return len(self.turns) == len(self.answer_at)

    def prompt(self) -> list[Message] | None:
        if self.finished:
            return None
        return self.messages() + self.kept[self._after_last(): self.answer_at[len(self.turns)]]

    def answer(self, turn: Turn) -> None:
        self.turns.append(turn)

    def stop(self, reason: str) -> None:
        """No more turns (the next prompt cannot be answered): keep what was answered."""
        self.answer_at = self.answer_at[: len(self.turns)]
        self.stop_reason = reason

    def _after_last(self) -> int:
        return self.answer_at[len(self.turns) - 1] + 1 if self.turns else 0

    def messages(self) -> list[Message]:
        """The conversation up to the last answered turn, with the generated answers."""
        out = list(self.kept[: self._after_last()])
        for j, turn in enumerate(self.turns):
            out[self.answer_at[j]] = Message("assistant", turn.text)
        return out


def prompt_tokens(render: Callable[[list[Message]], list[int]], dialogue: Dialogue,
                  max_context: int) -> list[int] | None:
    """The next turn's prompt ids, or None (and the dialogue stopped) when none is left or the
    prompt leaves no room for one new token within `max_context`."""
    msgs = dialogue.prompt()
    if msgs is None:
        return None
    ids = render(msgs)
    if len(ids) + 1 > max_context:
        dialogue.stop(TOO_LONG)
        return None
    return ids


def answer_text(tokenizer: Any, tokens: Sequence[int], stop_ids: set[int]) -> str:
    """The text of generated tokens. Special tokens are left out: the stop token that ended
    them (the chat template writes its own end-of-turn) and any other control token, which
    `tokenize` would refuse as content."""
    if tokens and tokens[-1] in stop_ids:
        tokens = tokens[:-1]
    return tokenizer.decode(list(tokens), skip_special_tokens=True)


def drive(backend, items: Sequence[Any], prompt: Callable[[Any], Any],
          request: Callable[[Any, Any], Any], answered: Callable[[Any, Any, Any], None],
          finished: Callable[[Any], None], synced: Callable[[], None] | None = None) -> None:
    """The conversation loop of `regenerate` (local engine and --endpoint) and `eval`.

    `items` each hold a `Dialogue`; `prompt(item)` is its next turn's prompt (None when it is
    over: `finished(item)` is called), `request(item, prompt)` the backend's request for it,
    whose completion comes back to `answered(item, prompt, completion)` (which answers or
    stops the dialogue). The backend's rows are kept full, next turns of started
    conversations first (so finished ones leave a reorder buffer soon): `backend.step(queue)`
    takes requests from the left of `queue` into free rows and returns completions with
    handle (item, prompt); `backend.free_rows` and `backend.busy` say what it holds.
    `synced()` runs after every step (progress, a stop request raising).
    """
    pending = collections.deque(items)
    queue: collections.deque = collections.deque()

    def next_turn(item, first: bool) -> None:
        p = prompt(item)
        if p is None:
            finished(item)
        elif first:
            queue.append(request(item, p))
        else:
            queue.appendleft(request(item, p))

    def top_up() -> None:
        while pending and len(queue) < max(backend.free_rows, 1):
            next_turn(pending.popleft(), first=True)

    top_up()
    while queue or backend.busy:
        if synced is not None:
            synced()
        for c in backend.step(queue):
            item, p = c.handle
            answered(item, p, c)
            next_turn(item, first=False)
        top_up()
    if synced is not None:
        synced()
