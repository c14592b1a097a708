"""Chat-template rendering and tokenization with an assistant-only loss mask.

The mask is found by prefix differences, which works with any template that renders a
conversation's prefixes as prefixes of its text (Llama 3, Qwen 2.5, Mistral, ChatML, ...):
assistant turn i spans from render(messages[:i], add_generation_prompt=True) to
render(messages[:i+1]) (the whole chat for its last turn). No `{% generation %}` markup is needed. Each piece (prompt text,
assistant text) is tokenized on its own, exactly as at inference, where the prompt is
tokenized and the reply generated token by token; so no token straddles a mask edge.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from itertools import chain

import fsspec
import numpy as np
from jinja2 import TemplateError, TemplateSyntaxError
from tokenizers import Tokenizer

from alignflow.job.data.formats import Message, RowError

try:  # transformers' compiled (sandboxed, cached) chat template: private, hence the fallback below
    from transformers.utils.chat_template_utils import _compile_jinja_template
except ImportError:
    _compile_jinja_template = None


def load_tokenizer(uri: str, chat_template: str | None = None):
    """An HF tokenizer from a directory URI; remote directories are copied locally first. One
    that needs its own code (`auto_map`) is refused, never run nor asked about."""
    from transformers import AutoTokenizer

    fs, path = fsspec.core.url_to_fs(uri)
    if not fs.isdir(path):  # else from_pretrained would take it for a hub id and go online
        raise FileNotFoundError(f"model.tokenizer: {uri} is not a directory")
    if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            _copy_dir(fs, path, tmp)
            tokenizer = AutoTokenizer.from_pretrained(tmp, trust_remote_code=False)
    if chat_template:
        tokenizer.chat_template = chat_template
    if not tokenizer.chat_template:
        raise ValueError(f"tokenizer {uri} has no chat_template; set model.chat_template")
    return tokenizer


def _copy_dir(fs: fsspec.AbstractFileSystem, path: str, dest: str) -> None:
    root = path.rstrip("/")
    for src in fs.find(root):
        local = os.path.join(dest, src[len(root) + 1 :])
        os.makedirs(os.path.dirname(local), exist_ok=True)
        fs.get_file(src, local)


def share_cores() -> None:
    """Size the tokenizer's thread pool (rayon's, read when first used) to this rank's share of
    the cores it may run on, split among the job's ranks on this node: ranks that each start a
    thread per core fight over the cores (2 ranks on 2 cores: 11% slower). A RAYON_NUM_THREADS
    set by the user wins."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))))


@dataclass(frozen=True)
class Request:
    """One chat to encode: the loss mask covers its assistant turns from index `train_from` on;
    a `generation_prompt` request is a prompt for generation (the template's generation prompt
    appended, nothing trained)."""

    messages: list[Message]
    train_from: int = 0
    generation_prompt: bool = False


@dataclass(frozen=True)
class Encoded:
    text: str  # the rendered chat
    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # int8, 1 on trained tokens
    prompt_length: int  # tokens before the first trained token


class ChatEncoder:
    """Renders messages with the tokenizer's chat template and tokenizes them, many at a time:
    one tokenizer call per batch keeps its per-call overhead off each row, and the tokens of a
    batch land in one array, of which each chat's ids and mask are views."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.backend = _plain_backend(tokenizer)

    def render(self, conversations: list[list[Message]], add_generation_prompt: bool = False) -> list[str]:
        """The conversations rendered as `apply_chat_template(..., tokenize=False)` renders them.
        Its template is called directly with the same arguments (the special tokens, no tools or
        documents): our messages are already plain {role, content} strings, so the sanitized copy
        apply_chat_template makes of each chat (a third of prep's rendering time) changes nothing."""
        try:
            if _compile_jinja_template is None:
                return self.tokenizer.apply_chat_template(conversations, tokenize=False, add_generation_prompt=add_generation_prompt)
            template, tokens = _compile_jinja_template(self.tokenizer.get_chat_template()), self.tokenizer.special_tokens_map
            return [
                template.render(messages=chat, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **tokens)
                for chat in conversations
            ]
        except TemplateSyntaxError as e:  # the template's fault, not the row's: never skipped
            raise ValueError(f"chat template does not parse: {e}") from None
        except TemplateError as e:  # e.g. "roles must alternate": the row's fault
            raise RowError(None, f"chat template: {e}") from None

    def tokens(self, pieces: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """What `tokenizer(pieces, add_special_tokens=False)["input_ids"]` gives, as one int32
        array and each piece's length, without its per-text Python overhead when the tokenizer
        is a fast one."""
        if self.backend is None:
            lists = self.tokenizer(pieces, add_special_tokens=False)["input_ids"]
        else:
            lists = [e.ids for e in self.backend.encode_batch_fast(pieces, add_special_tokens=False)]
        lengths = np.fromiter(map(len, lists), np.int64, len(lists))
        return np.fromiter(chain.from_iterable(lists), np.int32, int(lengths.sum())), lengths

    def encode(self, requests: list[Request]) -> list[Encoded | ValueError]:
        """Each request encoded, or the error that stopped it (RowError when it is the row's fault)."""
        pieces = self.pieces(requests)
        good = [p for p in pieces if not isinstance(p, ValueError)]
        ids, lengths = self.tokens([text for p in good for text, _ in p])
        mask = np.repeat(np.fromiter((trained for p in good for _, trained in p), np.int8, len(lengths)), lengths)
        starts = [0, *np.cumsum(lengths).tolist()]  # where each piece's tokens start
        encoded, first = [], 0  # first: the index of a chat's first piece
        for p in pieces:
            if isinstance(p, ValueError):
                encoded.append(p)
                continue
            start, end = starts[first], starts[first + len(p)]
            trained = next((i for i, (_, t) in enumerate(p) if t), len(p))
            encoded.append(Encoded("".join([text for text, _ in p]), ids[start:end], mask[start:end], starts[first + trained] - start))
            first += len(p)
        return encoded

    def pieces(self, requests: list[Request]) -> list[list[tuple[str, bool]] | ValueError]:
        """Each chat cut into (text, is_trained_assistant_turn) pieces, or the error that stopped
        it. A batch's renders take two calls (without and with the generation prompt); when one
        fails, each chat is rendered on its own, so that the error is the row's own."""
        try:
            texts = self._renders(requests)
        except ValueError:
            texts = None
        cut = []
        for k, r in enumerate(requests):
            try:
                cut.append(_cut(r, (lambda n, g, k=k: texts[k, n, g]) if texts else (lambda n, g, r=r: self.render([r.messages[:n]], g)[0])))
            except ValueError as e:
                cut.append(e)
        return cut

    def _renders(self, requests: list[Request]) -> dict[tuple[int, int, bool], str]:
        """(request, messages rendered, generation prompt) -> text, for every render the chats need."""
        keys = [(k, n, g) for k, r in enumerate(requests) for n, g in _renders_needed(r)]
        texts = {}
        for flag in (False, True):
            mine = [key for key in keys if key[2] == flag]
            if mine:
                texts |= zip(mine, self.render([requests[k].messages[:n] for k, n, _ in mine], flag))
        return texts


def _renders_needed(r: Request) -> list[tuple[int, bool]]:
    """(how many of its messages, with the generation prompt) for each render a chat's pieces need:
    the whole chat, and around each trained assistant turn i the first i messages with the
    generation prompt and the first i + 1 without (the whole chat, for its last turn)."""
    if r.generation_prompt:
        return [(len(r.messages), True)]
    needed = [(len(r.messages), False)]
    for i in _trained_turns(r):
        needed += [(i, True)] + ([(i + 1, False)] if i < len(r.messages) - 1 else [])
    return needed


def _trained_turns(r: Request) -> list[int]:
    return [i for i, m in enumerate(r.messages) if m["role"] == "assistant" and i >= r.train_from]


def _cut(r: Request, text) -> list[tuple[str, bool]]:
    """A chat's pieces from its renders (`text(messages, generation_prompt)`)."""
    full = text(len(r.messages), r.generation_prompt)
    if r.generation_prompt:
        return [(full, False)]
    pieces, pos = [], 0
    for i in _trained_turns(r):
        start = _prefix_length(full, text(i, True), i)
        end = len(full) if i == len(r.messages) - 1 else _prefix_length(full, text(i + 1, False), i)
        pieces += [(full[pos:start], False), (full[start:end], True)]
        pos = end
    pieces.append((full[pos:], False))
    return [(piece, trained) for piece, trained in pieces if piece]


def _prefix_length(full: str, prefix: str, turn: int) -> int:
    if not full.startswith(prefix):
        raise ValueError(
            f"chat template is not prefix-stable at assistant turn {turn}: rendering the first "
            "turns does not give a prefix of the whole chat, so the loss mask cannot be found"
        )
    return len(prefix)


def _plain_backend(tokenizer):
    """A fast tokenizer's Rust backend without truncation or padding, as transformers calls it
    when asked for neither; None for a slow tokenizer."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    return backend


def truncate(ids: np.ndarray, mask: np.ndarray, max_length: int, mode: str) -> tuple[np.ndarray, np.ndarray, bool]:
    """Cut to max_length keeping the start or the end; returns (ids, mask, was_truncated)."""
    if len(ids) <= max_length:
        return ids, mask, False
    if mode == "keep_start":
        return ids[:max_length], mask[:max_length], True
    if mode == "keep_end":
        return ids[len(ids) - max_length :], mask[len(mask) - max_length :], True
    raise ValueError(f"truncation must be keep_start or keep_end, got {mode!r}")
