"""The schema drafter: drafts a JSON reply's tokens from its JSON schema and the prompt, with no head.

A reply constrained by a JSON schema is mostly known before the model writes it: punctuation, the rest of a
key once its first letters are out, the closing quote of an enum value. The drafter tracks the reply against
the schema's grammar with xgrammar (the library vLLM's structured outputs use; cartspec parses no JSON
itself) and drafts text in two kinds of pieces until it has ``k`` tokens:

* **forced**: what the grammar leaves one way to write (``GrammarMatcher.find_jump_forward_string``);
* **chosen**, where the grammar leaves a choice, the first of these the grammar accepts:
  1. the prompt's continuation of the reply's last tokens (vLLM's n-gram lookup, ``drafting.lookup``):
     a multi-turn prompt holds earlier replies, and a value copied from the request continues as in it;
  2. inside a string value that has begun, the rest of the prompt's word it begins;
  3. an enum value the prompt names (``"free_shipping"`` for "free shipping"), then the next key in the
     schema's order;
  4. a number the prompt holds and the reply has not used yet; ``true``;
  5. ``]`` (an array of one); ``}`` where at most ``LAST_KEYS`` keys may follow and the prompt names none
     of them; a comma while keys remain; ``}``.

The drafted text is tokenized with the served tokenizer as one piece (so ``"`` and ``, `` become the one
token ``",`` that the model writes) and cut at ``k`` tokens and at the first token the grammar refuses.

The reply's formatting is one of ``FORMATS``, each compiled: the separators of Python's ``json.dumps``
(``", "``, ``": "``), then the ones without spaces (``","``, ``":"``: what vLLM's structured outputs write
with ``disable_any_whitespace``). A track follows the first; a reply that leaves it is replayed on the next
(``Track.feed``). A model that writes otherwise gets drafts refused by the verifier, never a wrong reply:
drafts are only proposals, which the target verifies. Where the reply leaves the grammar (a free-text answer, another
format), the track stops drafting for that request.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from .lookup import lookup as ngram_lookup
from .tokens import encoder

FORMATS = ((", ", ": "), (",", ":"))  # the separators a reply may write, in the order a track tries them
TRACKS = 512  # requests whose track ``SchemaGrammar.track_for`` keeps (a server's requests in flight)
MAX_PIECES = 32  # forced/chosen pieces per draft, a bound on the loop
LAST_KEYS = 2  # chosen on the dev split's greedy replies (docs/archive/2026-12-drafting-research.md)
SHORT_VALUE = 24  # characters: a string value this long so far is a copied value, not free text (``combine``)
_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9'&.+-]*")
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?")
_PROBE = "Qz\u00e9"  # text no key starts with: accepted only inside a free string


@dataclass(frozen=True)
class Vocabulary:
    """The strings a schema offers: property names in the schema's order, and each property's enum values."""

    keys: tuple[str, ...]
    enums: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, schema: dict[str, Any]) -> "Vocabulary":
        defs = schema.get("$defs", {})
        keys: list[str] = []
        enums: dict[str, list[str]] = {}

        def resolve(s: Any) -> Any:
            while isinstance(s, dict) and "$ref" in s:
                s = defs.get(s["$ref"].rsplit("/", 1)[-1], {})
            return s

        def values(s: Any) -> list[str]:
            s = resolve(s)
            if not isinstance(s, dict):
                return []
            out = [v for v in s.get("enum", []) if isinstance(v, str)]
            if isinstance(s.get("const"), str):
                out.append(s["const"])
            for sub in s.get("anyOf", []) + s.get("oneOf", []):
                out += values(sub)
            if "items" in s:
                out += values(s["items"])
            return out

        def walk(s: Any) -> None:
            s = resolve(s)
            if not isinstance(s, dict):
                return
            for name, sub in s.get("properties", {}).items():
                if name not in keys:
                    keys.append(name)
                vals = values(sub)
                if vals:
                    enums.setdefault(name, [])
                    enums[name] += [v for v in vals if v not in enums[name]]
                walk(sub)
            for sub in s.get("anyOf", []) + s.get("oneOf", []) + s.get("allOf", []):
                walk(sub)
            if "items" in s:
                walk(s["items"])

        walk(schema)
        return cls(tuple(keys), {k: tuple(v) for k, v in enums.items()})


_ALNUM = frozenset("abcdefghijklmnopqrstuvwxyz0123456789")


def _named(value: str, text: str) -> bool:
    """The prompt's text (lower case) names ``value``: its words (``_`` as a space) as whole words (no ASCII
    letter or digit on either side)."""
    return _names(value.replace("_", " ").lower().strip(), text)


def _names(words: str, text: str) -> bool:
    """``words`` occurs in ``text`` with no ASCII letter or digit on either side (``_named``, its words made)."""
    if not words:
        return False
    i = text.find(words)
    while i >= 0:
        j = i + len(words)
        if (i == 0 or text[i - 1] not in _ALNUM) and (j == len(text) or text[j] not in _ALNUM):
            return True
        i = text.find(words, i + 1)
    return False


def _accepts(m: Any, text: str) -> bool:
    """Would matcher ``m`` accept ``text`` next? ``m`` is left as it was: xgrammar leaves a matcher unchanged
    where it refuses a string and counts an accepted string as one step, which ``rollback`` undoes; no fork
    (a copy of the matcher's state) is made."""
    if not text:
        return True
    if m.accept_string(text):
        m.rollback(1)
        return True
    return False


def _stable(encode: Callable[[str], list[int]], text: str, ids: list[int], m: Any) -> int:
    """How many of ``text``'s tokens stay the same whatever punctuation the grammar (matcher ``m``, at the
    text's end) lets follow it: the last token of a text cut where the model's next token may merge with it
    (``"`` then ``,`` is the one token ``",``) is not drafted. A text that ends inside a string is not cut:
    what follows there is the value's words."""
    n = len(ids)
    for c in ('"', ",", " ", "]", "}"):
        if not _accepts(m, c):
            continue
        more = encode(text + c)
        i = 0
        while i < n and i < len(more) and more[i] == ids[i]:
            i += 1
        n = i
    return n


class SchemaGrammar:
    """A schema compiled for one tokenizer (shared by every request with that schema)."""

    def __init__(self, tokenizer: Any, schema: dict[str, Any] | str, compiler: Any = None):
        import xgrammar as xgr

        self.schema = json.loads(schema) if isinstance(schema, str) else schema
        self.tokenizer = tokenizer
        self.compiler = compiler or xgr.GrammarCompiler(
            xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer)))
        self.compiled = [self.compiler.compile_json_schema(json.dumps(self.schema), any_whitespace=False,
                                                           separators=sep, strict_mode=False) for sep in FORMATS]
        self.vocab = Vocabulary.of(self.schema)
        self._encode: Callable[[str], list[int]] = encoder(tokenizer)
        self._tracks: dict[tuple, Track] = {}

    def track(self, prompt: Sequence[int], prompt_text: str | None = None) -> "Track":
        """A request's track: its reply is fed token by token (``Track.feed``)."""
        return Track(self, prompt, prompt_text)

    def track_for(self, context: Sequence[int], prompt_len: int) -> "Track":
        """The track of the request whose prompt + reply so far is ``context``, fed up to it: for callers that
        see contexts rather than requests (a hybrid rule's step). Kept per prompt (the latest ``TRACKS``); a
        context that does not extend the kept reply starts a new track."""
        ctx = [int(t) for t in context]
        key = tuple(ctx[:prompt_len])
        tr = self._tracks.pop(key, None)
        if tr is None or ctx[prompt_len:prompt_len + len(tr.reply)] != tr.reply:
            tr = self.track(key)
        self._tracks[key] = tr  # most recent last
        if len(self._tracks) > TRACKS:
            self._tracks.pop(next(iter(self._tracks)))
        tr.feed(ctx[prompt_len:])
        return tr


class Track:
    """One request's reply followed through the grammar; ``draft`` proposes its next tokens."""

    def __init__(self, grammar: SchemaGrammar, prompt: Sequence[int], prompt_text: str | None = None,
                 n_min: int = 2, n_max: int = 4):
        import xgrammar as xgr

        self.g = grammar
        self.prompt = [int(t) for t in prompt]
        text = prompt_text if prompt_text is not None else grammar.tokenizer.decode(self.prompt)
        self.text = text.lower()
        self.numbers = _NUMBER.findall(text)
        self.words = {m.group(0).lower() for m in _WORD.finditer(text)}
        # what the prompt names, once per request: enum values, and keys named or with a value named
        vocab = grammar.vocab
        self.named_values = [v for vals in vocab.enums.values() for v in vals if _named(v, self.text)]
        self.named_keys = {k for k in vocab.keys if _named(k, self.text) or
                           any(_named(v, self.text) for v in vocab.enums.get(k, ()))}
        self.format = 0  # which of ``FORMATS`` the reply follows
        self.matcher = xgr.GrammarMatcher(grammar.compiled[0], terminate_without_stop_token=True)
        self.reply: list[int] = []
        self.reply_text = ""
        self.alive = True
        self.n_min, self.n_max = n_min, n_max

    def feed(self, reply: Sequence[int]) -> None:
        """The reply so far (all of it, each step): the tokens not yet seen advance the grammar. Where the
        grammar refuses one, the whole reply is replayed on the next of ``FORMATS``; where none takes it, the
        track stops (the reply is not this schema's JSON)."""
        new = [int(t) for t in reply[len(self.reply):]]
        if not new:
            return
        self.reply += new
        if not self.alive:
            return
        if not self._accept(self.matcher, new):
            self.alive = False
            import xgrammar as xgr

            while self.format + 1 < len(FORMATS):
                self.format += 1
                m = xgr.GrammarMatcher(self.g.compiled[self.format], terminate_without_stop_token=True)
                if self._accept(m, self.reply):
                    self.matcher, self.alive = m, True
                    break
            if not self.alive:
                return
        self.reply_text = self.g.tokenizer.decode(self.reply)

    @staticmethod
    def _accept(m: Any, tokens: Sequence[int]) -> bool:
        for t in tokens:
            if m.is_terminated() or not m.accept_token(t):
                return False
        return True

    def draft(self, k: int, after: Sequence[int] = ()) -> list[int]:
        """Up to ``k`` draft tokens after the reply fed so far and then ``after`` ([] where nothing is drafted,
        or where the grammar refuses ``after``)."""
        if not self.alive or k <= 0 or self.matcher.is_terminated():
            return []
        m = self.matcher.fork()
        after = [int(t) for t in after]
        if not all(m.accept_token(t) for t in after):
            return []
        start = self.g.tokenizer.decode(after) if after else ""
        check = m.fork()
        text = ""
        for _ in range(MAX_PIECES):
            piece = m.find_jump_forward_string()
            if not piece:
                piece = self._choose(m, start + text, after, text)
                if not piece or not m.accept_string(piece):
                    break
            else:
                m.accept_string(piece)
            text += piece
            if m.is_terminated() or len(text) >= 8 * k and len(self.g._encode(text)) > k:
                break
        if not text:
            return []
        ids = self.g._encode(text)
        if len(ids) <= k and not m.is_terminated() and not _accepts(m, _PROBE):
            ids = ids[:_stable(self.g._encode, text, ids, m)]
        out = []
        for t in ids[:k]:
            if not check.accept_token(t):
                break
            out.append(t)
        return out

    def forced(self, m: Any) -> int | None:
        """The next token where the grammar (matcher ``m``) leaves one way to write the next text and that text
        starts with the same token whatever follows it; None where the grammar leaves a choice."""
        fs = m.find_jump_forward_string()
        if not fs:
            return None
        ids = self.g._encode(fs)
        after = m.fork()
        after.accept_string(fs)
        if not after.is_terminated() and not _accepts(after, _PROBE) and \
                _stable(self.g._encode, fs, ids, after) < 1:
            return None
        return ids[0] if ids else None

    def combine(self, head: Sequence[int]) -> list[int]:
        """A head's draft with the schema drafter's: the head's tokens stand while the grammar accepts them,
        except inside a string value, where a copy the schema drafter finds in the prompt replaces them (the
        head drafts copied values worst); from the first token the grammar refuses (which the target, writing
        the schema's JSON, would reject too) the schema drafter drafts the rest."""
        head = [int(t) for t in head]
        if not self.alive or self.matcher.is_terminated():
            return head
        m = self.matcher.fork()
        for j, h in enumerate(head):
            if _accepts(m, _PROBE) and self._short_value(head[:j]):  # the prompt's copy, if any
                own = self.draft(len(head) - j, head[:j])
                if own and own[0] != h and not self.g.tokenizer.decode(own[:1]).startswith('"'):
                    return head[:j] + own  # a copy of the prompt's words (where the value ends, the head judges)
            if not m.accept_token(h):
                return head[:j] + self.draft(len(head) - j, head[:j])
        return head

    def _short_value(self, after: Sequence[int]) -> bool:
        """The string value being written is still short (``SHORT_VALUE`` characters): a copied value, not a
        free-text answer, where the head drafts better than any copy."""
        so_far = self.reply_text + (self.g.tokenizer.decode(list(after)) if after else "")
        return len(so_far) - so_far.rfind('"') - 1 <= SHORT_VALUE

    # --- the choices where the grammar leaves one -------------------------------------------------------

    def _choose(self, m: Any, so_far: str, after: Sequence[int], text: str) -> str | None:
        """The first of ``_options`` the grammar accepts. Each first character is tried once: where the grammar
        refuses it (a quote after a closed value), every option it starts is refused too, untried."""
        first: dict[str, bool] = {}
        for option in self._options(m, so_far, after, text):
            if not option:
                continue
            ok = first.get(option[0])
            if ok is None:
                ok = first[option[0]] = _accepts(m, option[0])
            if ok and _accepts(m, option):
                return option
        return None

    def _options(self, m: Any, so_far: str, after: Sequence[int], text: str) -> Iterable[str]:
        """The choices in the order tried (module doc); ``so_far``: the drafted text after the reply fed, ``after``
        the tokens drafted before ``text``."""
        so_far = self.reply_text + so_far
        ctx = self.prompt + self.reply + list(after) + (self.g._encode(text) if text else [])
        look = ngram_lookup(ctx, 8, self.n_min, self.n_max, limit=len(self.prompt))
        if look:
            yield self.g.tokenizer.decode(look)
        digits = re.search(r"(?<![\w.])\d+(?:\.\d*)?$", so_far)
        if digits:  # a number has begun: the prompt's number it begins
            for n in self.numbers:
                if n.startswith(digits.group(0)) and len(n) > len(digits.group(0)):
                    yield n[len(digits.group(0)):]
        if _accepts(m, _PROBE):  # inside a string value
            begun = re.search(r"[^\"]*$", so_far).group(0).lower()
            words = begun.split()
            part = words[-1] if words and not begun.endswith(" ") else ""
            if part:
                done = part in self.words
                for w in sorted(self.words):
                    if w.startswith(part) and len(w) > len(part):
                        yield w[len(part):]
                        break
                if done:
                    yield '"'
            return
        if _accepts(m, '"' + _PROBE):  # a free string may start: open it (the words come next)
            yield '"'
            return
        vocab = self.g.vocab
        partial = re.search(r'"([A-Za-z0-9_]+)$', so_far)
        if partial:  # a key or an enum value has begun: its rest, in the schema's order
            p = partial.group(1)
            for w in list(vocab.keys) + [v for vals in vocab.enums.values() for v in vals]:
                if w.startswith(p) and len(w) > len(p):
                    yield w[len(p):] + '"'
        for v in self.named_values:
            yield f'"{v}"'
            yield f'{v}"'
        for key in vocab.keys:
            yield f'"{key}"'
            yield f'{key}"'
        for n in self.numbers:
            if n not in so_far:
                yield n
        yield '"'
        yield "true"
        yield "]"
        if self._object_ends(m):
            yield "}"
        yield ", "
        yield ","
        yield "}"

    def _object_ends(self, m: Any) -> bool:
        """At most ``LAST_KEYS`` keys may still follow and the prompt names none of them (nor, for an enum
        key, any of its values): the object most likely ends here."""
        vocab = self.g.vocab
        left = [k for k in vocab.keys if _accepts(m, f', "{k}"') or _accepts(m, f',"{k}"')]
        if len(left) > LAST_KEYS:
            return False
        return not any(k in self.named_keys for k in left)
