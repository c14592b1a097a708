"""Row formats of the SFT, preference and RL-prompt datasets, normalised to chat messages.

Every format becomes messages so that one code path (the tokenizer's chat template) renders
them all. Formats follow the conventions users bring from TRL and NeMo-Aligner:

- sft: `messages` [{role, content}, ...]; `prompt_completion` (TRL: strings, or a message
  list prompt and an assistant message list completion); `input_output` (NeMo: strings).
- preference: `preference` (TRL: `prompt`/`chosen`/`rejected`, each a string or a message
  list); `nemo_preference` (`prompt`/`chosen_response`/`rejected_response`).
- prompts: `prompt_answer` (`prompt`, string or messages, plus a ground-truth answer field).

A string prompt is one user turn; a string completion, chosen or rejected is one assistant turn.
"""

from __future__ import annotations

from dataclasses import dataclass

Message = dict[str, str]

# kind -> format -> required keys, in detection order ("answer" stands for the answer key).
FORMATS: dict[str, dict[str, tuple[str, ...]]] = {
    "sft": {
        "messages": ("messages",),
        "prompt_completion": ("prompt", "completion"),
        "input_output": ("input", "output"),
    },
    "preference": {
        "nemo_preference": ("prompt", "chosen_response", "rejected_response"),
        "preference": ("prompt", "chosen", "rejected"),
    },
    "prompts": {"prompt_answer": ("prompt", "answer")},
}
ROLES = ("system", "user", "assistant", "tool")


class RowError(ValueError):
    """A row that does not fit its format; `field` names where (None: the whole row)."""

    def __init__(self, field: str | None, message: str):
        super().__init__(f"field {field!r}: {message}" if field else message)
        self.field = field


@dataclass(frozen=True)
class Chat:
    messages: list[Message]


@dataclass(frozen=True)
class PreferencePair:
    prompt: list[Message]
    chosen: list[Message]
    rejected: list[Message]


@dataclass(frozen=True)
class PromptAnswer:
    prompt: list[Message]
    answer: str


def required_keys(kind: str, fmt: str, answer_key: str = "answer") -> tuple[str, ...]:
    return tuple(answer_key if k == "answer" else k for k in FORMATS[kind][fmt])


def detect_format(kind: str, row: dict, answer_key: str = "answer") -> str:
    """The first format of `kind` whose keys the row has (the `auto` format)."""
    for fmt in FORMATS[kind]:
        if all(k in row for k in required_keys(kind, fmt, answer_key)):
            return fmt
    expected = "; ".join(f"{f}: {', '.join(required_keys(kind, f, answer_key))}" for f in FORMATS[kind])
    raise ValueError(f"cannot detect the format from keys {sorted(row)}; expected one of ({expected})")


def check_format(kind: str, fmt: str) -> None:
    if fmt != "auto" and fmt not in FORMATS[kind]:
        raise ValueError(f"format {fmt!r} is not a {kind} format; use auto or one of {sorted(FORMATS[kind])}")


def parse_row(kind: str, fmt: str, row: dict, answer_key: str = "answer") -> Chat | PreferencePair | PromptAnswer:
    """Validate one row of a known format and normalise it; raises RowError."""
    for key in required_keys(kind, fmt, answer_key):
        if key not in row or row[key] is None:
            raise RowError(key, "missing")
    if fmt == "messages":
        return Chat(_chat(parse_messages(row["messages"], "messages"), "messages"))
    if fmt == "prompt_completion":
        completion = parse_turns(row["completion"], "completion", "assistant")
        return Chat(_chat(parse_prompt(row["prompt"], "prompt") + completion, "completion"))
    if fmt == "input_output":
        user, reply = parse_text(row["input"], "input"), parse_text(row["output"], "output", nonempty=True)
        return Chat([{"role": "user", "content": user}, {"role": "assistant", "content": reply}])
    if fmt in ("preference", "nemo_preference"):
        chosen, rejected = ("chosen", "rejected") if fmt == "preference" else ("chosen_response", "rejected_response")
        return PreferencePair(
            prompt=parse_prompt(row["prompt"], "prompt"),
            chosen=_reply(row[chosen], chosen),
            rejected=_reply(row[rejected], rejected),
        )
    if fmt == "prompt_answer":
        return PromptAnswer(parse_prompt(row["prompt"], "prompt"), _answer(row[answer_key], answer_key))
    raise ValueError(f"unknown {kind} format {fmt!r}")


def parse_text(value, field: str, nonempty: bool = False) -> str:
    if not isinstance(value, str):
        raise RowError(field, f"expected a string, got {type(value).__name__}")
    if nonempty and not value.strip():
        raise RowError(field, "empty")
    return value


def parse_messages(value, field: str) -> list[Message]:
    """A list of {role, content} with string contents (multimodal parts are not supported); an
    error names the message and key at fault (`messages[1].content`)."""
    if not isinstance(value, list) or not value:
        raise RowError(field, f"expected a non-empty list of {{role, content}}, got {_shown(value)}")
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise RowError(f"{field}[{i}]", f"expected {{role, content}}, got {_shown(m)}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise RowError(f"{field}[{i}].{key}", f"expected a string, got {_shown(m.get(key))}")
        if m["role"] not in ROLES:
            raise RowError(f"{field}[{i}].role", f"unknown role {m['role']!r}; expected one of {', '.join(ROLES)}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _shown(value) -> str:
    """A wrong value as a user recognises it: `int 42`, `missing`, `list [...]`."""
    if value is None:
        return "nothing (missing or null)"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def parse_turns(value, field: str, role: str) -> list[Message]:
    """A string is one turn of `role`; a list is taken as messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return parse_messages(value, field)


def parse_prompt(value, field: str) -> list[Message]:
    prompt = parse_turns(value, field, "user")
    if prompt[-1]["role"] == "assistant":
        raise RowError(field, "a prompt must not end with an assistant turn")
    return prompt


def _chat(msgs: list[Message], field: str) -> list[Message]:
    """A training chat needs at least one assistant turn, and none of them empty."""
    replies = [m for m in msgs if m["role"] == "assistant"]
    if not replies:
        raise RowError(field, "no assistant turn")
    if any(not m["content"].strip() for m in replies):
        raise RowError(field, "empty assistant content")
    return msgs


def _reply(value, field: str) -> list[Message]:
    reply = _chat(parse_turns(value, field, "assistant"), field)
    if reply[0]["role"] != "assistant":
        raise RowError(field, "must start with an assistant turn")
    return reply


def _answer(value, field: str) -> str:
    """Ground truth as text; numbers are accepted since JSON and Parquet often store them so."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise RowError(field, f"expected a string or number, got {type(value).__name__}")
    return str(value)
