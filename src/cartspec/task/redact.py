"""Redaction of recorded traffic: personal data in a record becomes a pseudonym of the same shape.

``Redactor`` masks order ids, e-mail addresses and phone numbers (and the
user's own regexes) in the query, the history, the messages and the reply. A
masked value becomes a pseudonym of the same shape (digits stay digits, letters
stay letters in the same case, separators stay), derived from a keyed BLAKE2b
hash of the value, so the same value gets the same pseudonym wherever it
appears: a reply that copies an order id from the request copies its pseudonym.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Literal, Sequence

from .data import Turn

if TYPE_CHECKING:
    from .traffic import TrafficRecord


# --- redaction ------------------------------------------------------------------------------------------------

# a value starts at a word boundary, not after a currency sign, a decimal point, "+", "#" or "-"
_NOT_AFTER = r"(?<![\w$€£¥.,+#-])"


@dataclass(frozen=True)
class _Pattern:
    kind: Literal["order_id", "email", "phone", "user"]
    regex: re.Pattern[str]
    min_alnum: int = 0        # fewer letters/digits than this in the masked value: not a match
    needs_digit: bool = False
    digits: tuple[int, int] | None = None  # (min, max) digits in the masked value

    def spans(self, text: str) -> Iterable[tuple[int, int]]:
        for m in self.regex.finditer(text):
            group = "v" if "v" in self.regex.groupindex else 0
            start, end = m.span(group)
            if start < 0 or end <= start:
                continue
            value = text[start:end]
            alnum = sum(c.isalnum() for c in value)
            n_digits = sum(c.isdigit() for c in value)
            if alnum < self.min_alnum or (self.needs_digit and not n_digits):
                continue
            if self.digits and not self.digits[0] <= n_digits <= self.digits[1]:
                continue
            yield start, end


_ID = r"[A-Z0-9]+(?:[-_][A-Z0-9]+)*"
DEFAULT_PATTERNS: tuple[_Pattern, ...] = (
    # e-mail addresses
    _Pattern("email", re.compile(r"(?<![\w.+-])[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b")),
    # phone numbers: international "+44 20 7946 0958", "+1-555-123-4567"
    _Pattern("phone", re.compile(r"(?<![\w$€£¥+])\+\d{1,3}(?:[\s.-]?\(?\d{1,4}\)?){2,5}(?![\w])"), digits=(8, 15)),
    # ... and North American "(555) 123-4567", "555-123-4567", "555.123.4567" (three groups, separated)
    _Pattern("phone", re.compile(_NOT_AFTER + r"(?:\(\d{3}\)\s?|\d{3}[\s.-])\d{3}[\s.-]\d{4}(?!\w|[.,-]\d)")),
    # order ids: "ORD-2024-00123" (the prefix is kept), "order 12345678", "order no. A123-4567", "#123456"
    _Pattern("order_id", re.compile(r"\bORD[-_#:]?(?P<v>" + _ID + r")\b", re.I), min_alnum=4, needs_digit=True),
    _Pattern("order_id", re.compile(r"\border\s*(?:(?:no|nr|number|id)\b\.?\s*)?[:#]?\s*"
                                    r"(?P<v>(?=[A-Z_-]*\d)" + _ID + r")\b", re.I), min_alnum=5, needs_digit=True),
    _Pattern("order_id", re.compile(r"(?<![\w&])#(?P<v>" + _ID + r")\b", re.I), min_alnum=4, needs_digit=True),
    # the commerce task's own ids: "W123-4567" (any case: a capitalised query lower-cases it)
    _Pattern("order_id", re.compile(r"\b[A-Z]{1,3}\d{2,}-\d{3,}\b", re.I)),
    # any other run of 7 or more digits (no price or size in this task has that many)
    _Pattern("order_id", re.compile(_NOT_AFTER + r"\d{7,}(?!\w|[.,]\d)")),
)


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """A user's redaction regex; a clear error when it does not compile or matches empty text."""
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise ValueError(f"redaction pattern {pattern!r} is not a valid regular expression: {e}") from None
    if rx.fullmatch(""):
        raise ValueError(f"redaction pattern {pattern!r} matches empty text: it must match at least one character")
    return rx


def _key_bytes(key: bytes | str | None) -> bytes:
    if key is None:
        return os.urandom(32)
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if not raw:
        raise ValueError("redact_key must not be empty (leave it unset for a random key per writer)")
    return hashlib.blake2b(raw, digest_size=32, person=b"cartspec-rkey").digest()


_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


class Redactor:
    """Masks personal data in a record: order ids, e-mails and phone numbers by default, plus ``patterns``.

    A user pattern masks its whole match, or only its named group ``v`` when it
    has one (``r"cust(?P<v>\\d+)"`` keeps the prefix). The pseudonym of a value
    depends on its letters and digits (upper-cased, separators ignored) and on
    ``key``: the same key gives the same pseudonyms in every record and every
    file; without a key each ``Redactor`` draws a random one.
    """

    def __init__(self, patterns: Sequence[str] = (), defaults: bool = True, *, key: bytes | str | None = None):
        self.patterns: list[_Pattern] = list(DEFAULT_PATTERNS) if defaults else []
        self.patterns += [_Pattern("user", compile_pattern(p)) for p in patterns]
        self._key = _key_bytes(key)

    # -- pseudonyms --
    def _stream(self, value: str, n: int) -> bytes:
        out, counter = b"", 0
        while len(out) < n:
            out += hashlib.blake2b(value.encode(), key=self._key, digest_size=64,
                                   salt=counter.to_bytes(16, "little")).digest()
            counter += 1
        return out

    def pseudonym(self, value: str, kind: str = "order_id") -> str:
        """The same-shape stand-in for ``value``: ``user-1a2b3c@example.com`` for an e-mail."""
        if kind == "email":
            digest = hashlib.blake2b(value.casefold().encode(), key=self._key, digest_size=3).hexdigest()
            return f"user-{digest}@example.com"
        norm = "".join(c for c in value if c.isascii() and c.isalnum()).upper()
        stream = self._stream(norm, len(norm))
        out, i, prev_digit = [], 0, False
        for c in value:
            if not (c.isascii() and c.isalnum()):
                out.append(c)
                prev_digit = False
                continue
            b = stream[i]
            i += 1
            if c.isdigit():
                # the first digit of a number stays non-zero when it was, so "12345678" stays an 8-digit number
                out.append(str(1 + b % 9) if not prev_digit and c != "0" else str(b % 10))
                prev_digit = True
            else:
                letter = _LETTERS[b % 26]
                out.append(letter.lower() if c.islower() else letter)
                prev_digit = False
        return "".join(out)

    # -- text --
    def redact_text(self, text: str) -> tuple[str, int]:
        """``text`` with every match masked, and how many spans were masked. Earlier patterns win overlaps."""
        if not text or not self.patterns:
            return text, 0
        taken: list[tuple[int, int, str]] = []
        for pat in self.patterns:
            for start, end in pat.spans(text):
                if any(start < e and s < end for s, e, _ in taken):
                    continue
                taken.append((start, end, pat.kind))
        if not taken:
            return text, 0
        taken.sort()
        parts, pos = [], 0
        for start, end, kind in taken:
            parts += [text[pos:start], self.pseudonym(text[start:end], kind)]
            pos = end
        parts.append(text[pos:])
        return "".join(parts), len(taken)

    def redact_record(self, rec: TrafficRecord) -> TrafficRecord:
        """A copy of ``rec`` with its query, history, messages (every value but ``role``) and reply masked;
        ``redactions`` counts the spans masked (added to what it already counted)."""
        count = 0

        def mask(text: str) -> str:
            nonlocal count
            masked, n = self.redact_text(text)
            count += n
            return masked

        query = mask(rec.query)
        history = [Turn(role=t.role, content=mask(t.content)) for t in rec.history]
        messages = [{k: (v if k == "role" or not isinstance(v, str) else mask(v)) for k, v in m.items()}
                    for m in rec.messages]
        reply = mask(rec.reply)
        return rec.model_copy(update={"query": query, "history": history, "messages": messages, "reply": reply,
                                      "redactions": rec.redactions + count})
