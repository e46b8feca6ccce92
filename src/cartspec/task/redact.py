"""Redaction of recorded traffic: personal data in a record becomes a pseudonym of the same shape.

``Redactor`` normalises a record's text (NFKC, every Unicode digit to ASCII) and finds personal data in
the query, the history, the messages and the reply: e-mail addresses, phone numbers (``phonenumbers``),
card numbers, IBANs, US SSNs and some national ids (``python-stdnum``), order ids, values of JSON fields
named like personal data (``"order_id"``, ``"email"``...) and the user's own regexes. Every value found
anywhere in the record is then replaced in every field, so a reply that copies an id from the query
copies its pseudonym. A pseudonym keeps the value's shape and comes from a keyed BLAKE2b hash of it.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import os
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Protocol, Sequence, TypeVar

import phonenumbers
from stdnum import iban as std_iban
from stdnum import luhn
from stdnum.es import dni as es_dni
from stdnum.es import nie as es_nie
from stdnum.fr import nir as fr_nir
from stdnum.in_ import aadhaar as in_aadhaar
from stdnum.it import codicefiscale as it_cf
from stdnum.us import ssn as us_ssn

from .data import Turn


class Record(Protocol):
    """What ``Redactor.redact_record`` reads and rewrites of a record (``task.traffic.TrafficRecord``, which
    imports this module: the record's type is named here by its shape only)."""

    query: str
    history: list[Turn]
    messages: list[dict[str, str]]
    reply: str
    redactions: int

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> Any: ...


RecordT = TypeVar("RecordT", bound=Record)

Kind = Literal["email", "card", "iban", "ssn", "national_id", "phone", "order_id", "user"]

DEFAULT_PHONE_REGIONS: tuple[str, ...] = ("US", "GB", "FR", "DE", "ES", "IT", "NL", "IN")


# --- normalisation ------------------------------------------------------------------------------------------------

class _DigitsToAscii(dict):
    """A ``str.translate`` table, filled on first sight of a character: a Unicode decimal digit (Arabic-Indic,
    Devanagari...; NFKC keeps them) becomes its ASCII digit, and invisible characters that could split a value
    (zero-width space, word joiner, BOM, soft hyphen) are dropped."""

    _DROP = frozenset({0x200B, 0x2060, 0xFEFF, 0x00AD})

    def __missing__(self, cp: int) -> int | str | None:
        if cp in self._DROP:
            out: int | str | None = None
        else:
            d = unicodedata.decimal(chr(cp), None)
            out = str(d) if d is not None and cp >= 128 else cp
        self[cp] = out
        return out


_DIGITS = _DigitsToAscii()


def normalise(text: str) -> str:
    """NFKC, then every Unicode decimal digit as ASCII: the form in which values are matched and written."""
    if text.isascii():
        return text
    return unicodedata.normalize("NFKC", text).translate(_DIGITS)


# --- finding values -----------------------------------------------------------------------------------------------

# a value starts at a word boundary, not after a currency sign, a decimal point, "+", "#" or "-"
_NOT_AFTER = r"(?<![\w$€£¥.,+#-])"


@dataclass(frozen=True)
class _Pattern:
    """A regex whose matches (or their group ``v``) are masked, subject to letter/digit counts."""

    kind: Kind
    regex: re.Pattern[str]
    min_alnum: int = 0        # fewer letters/digits than this in the masked value: not a match
    needs_digit: bool = False

    def spans(self, text: str) -> Iterable[tuple[int, int]]:
        group = "v" if "v" in self.regex.groupindex else 0
        for m in self.regex.finditer(text):
            start, end = m.span(group)
            if start < 0 or end <= start:
                continue
            value = text[start:end]
            alnum = len(value) if value.isalnum() else sum(c.isalnum() for c in value)
            if alnum < self.min_alnum:
                continue
            if self.needs_digit and not value.isdigit() and not any(c.isdigit() for c in value):
                continue
            yield start, end


@dataclass(frozen=True)
class _Checked:
    """A shape found by a regex, kept only when a ``python-stdnum`` validator accepts its letters and digits.

    With ``groups``, the match is a run of separated groups and the longest run of whole groups (from the
    first) that validates is taken: "GB82 WEST 1234 5698 7654 32 thanks" ends before "thanks"."""

    kind: Kind
    regex: re.Pattern[str]
    valid: Callable[[str], bool]
    groups: bool = False

    def spans(self, text: str) -> Iterable[tuple[int, int]]:
        for m in self.regex.finditer(text):
            start, end = m.span()
            ends = [g.end() + start for g in _ALNUM_RUN.finditer(m.group())] if self.groups else [end]
            for e in reversed(ends):
                if self.valid(_alnum(text[start:e]).upper()):
                    yield start, e
                    break


_ALNUM_RUN = re.compile(r"[^\W_]+")


def _alnum(s: str) -> str:
    return "".join(c for c in s if c.isalnum())


def _card(digits: str) -> bool:
    return 13 <= len(digits) <= 19 and digits.isdigit() and luhn.is_valid(digits)


def _safe(validator: Callable[[str], bool]) -> Callable[[str], bool]:
    def valid(value: str) -> bool:
        try:
            return bool(validator(value))
        except Exception:  # a validator that chokes on an odd candidate: not that kind of id
            return False
    return valid


_B = r"(?<![^\W_])"   # not right after a letter or digit
_E = r"(?![^\W_])"    # not right before one

EMAIL = _Pattern("email", re.compile(
    r"(?<![\w.%+-])[\w.%+-]+@(?:[^\W_](?:[\w-]*[^\W_])?\.)+[^\W\d_]{2,}(?!\w)"))

CHECKED: tuple[_Checked, ...] = (
    # cards: 13-19 digits, compact or in groups of spaces or dashes, Luhn-valid (Visa 4-4-4-4, Amex 4-6-5...)
    _Checked("card", re.compile(_NOT_AFTER + r"\d(?:[ -]?\d){12,18}" + _E), _safe(_card), groups=True),
    # IBANs, compact or in groups of four: country, check digits, then the account (mod-97 and length checked)
    _Checked("iban", re.compile(_B + r"[A-Z]{2}\d{2}(?: ?[A-Z0-9]){11,32}" + _E, re.I), _safe(std_iban.is_valid),
             groups=True),
    # US SSNs written 123-45-6789 or 123 45 6789 (area, group and serial checked)
    _Checked("ssn", re.compile(_NOT_AFTER + r"\d{3}([- ])\d{2}\1\d{4}" + _E), _safe(us_ssn.is_valid)),
    # national ids with a check character: Spanish DNI / NIE, Italian codice fiscale, French NIR, Aadhaar
    _Checked("national_id", re.compile(_B + r"(?:\d{8}|[XYZ]-?\d{7})-?[A-Z]" + _E, re.I),
             _safe(lambda v: es_dni.is_valid(v) or es_nie.is_valid(v))),
    _Checked("national_id", re.compile(_B + r"[A-Z]{6}[0-9LMNP-V]{2}[A-Z][0-9LMNP-V]{2}[A-Z][0-9LMNP-V]{3}[A-Z]"
                                       + _E, re.I), _safe(it_cf.is_valid)),
    _Checked("national_id", re.compile(_NOT_AFTER + r"[12] ?\d{2} ?\d{2} ?(?:\d{2}|2A|2B) ?\d{3} ?\d{3} ?\d{2}"
                                       + _E, re.I), _safe(fr_nir.is_valid)),
    _Checked("national_id", re.compile(_NOT_AFTER + r"\d{4}[ -]\d{4}[ -]\d{4}" + _E), _safe(in_aadhaar.is_valid)),
)

_ID = r"[A-Z0-9]+(?:[-_][A-Z0-9]+)*"
ORDER_IDS: tuple[_Pattern, ...] = (
    # "ORD-2024-00123" (the prefix is kept), "order 12345678", "order no. A123-4567", "#123456"
    _Pattern("order_id", re.compile(r"\bORD[-_#:]?(?P<v>" + _ID + r")\b", re.I), min_alnum=4, needs_digit=True),
    _Pattern("order_id", re.compile(r"\border\s*(?:(?:no|nr|number|id)\b\.?\s*)?[:#]?\s*"
                                    r"(?P<v>(?=[A-Z_-]*\d)" + _ID + r")\b", re.I), min_alnum=5, needs_digit=True),
    _Pattern("order_id", re.compile(r"(?<![\w&])#(?P<v>" + _ID + r")\b", re.I), min_alnum=4, needs_digit=True),
    # the commerce task's own ids: "W123-4567" (any case: a capitalised query lower-cases it)
    _Pattern("order_id", re.compile(r"\b[A-Z]{1,3}\d{2,}-\d{3,}\b", re.I)),
    # any other run of 7 or more digits (no price or size in this task has that many)
    _Pattern("order_id", re.compile(_NOT_AFTER + r"\d{7,}(?!\w|[.,]\d)")),
)
DEFAULT_PATTERNS: tuple[_Pattern, ...] = (EMAIL, *ORDER_IDS)

# digits in groups, the way phone numbers are written; phonenumbers decides which of these runs are phones
_PHONE_RUN = re.compile(r"(?<![\w$€£¥.,])(?:\+ ?)?\(?\d(?:[ ().\-/]{1,3}\(?\d|\d)*\)?")
_NANP_GROUPS = ([3, 3, 4], [10], [3, 7])


class _Phones:
    """Phone numbers in ``regions``' national formats, and in international form (``+44 ...``, ``0044 ...``).

    A number is kept when ``phonenumbers`` finds it valid for one of the regions and grouped the way that
    region writes it (so "12 34 56 78 90" is not an Indian mobile number); one in international form when it
    is possible. North American numbers (country code 1) need only be possible, as the fictional
    ``555-123-4567`` is, when grouped 3-3-4; a 7-digit local ``555-1234`` counts unless both its parts are
    round (a range such as ``200-5000``). Dotted numbers use only dots (``49.99-199.99`` is a price range).
    """

    def __init__(self, regions: Sequence[str]):
        self.regions = check_phone_regions(regions)
        self._nanp = tuple(r for r in self.regions if phonenumbers.country_code_for_region(r) == 1)
        # the fewest digits a valid number of the region has: shorter runs need not be tried there
        self._min_digits = {r: min(phonenumbers.PhoneMetadata.metadata_for_region(r).general_desc.possible_length)
                            for r in self.regions}
        self.find = functools.lru_cache(maxsize=8192)(self._find)

    def spans(self, text: str, taken: bytearray) -> Iterable[tuple[int, int]]:
        for m in _PHONE_RUN.finditer(text):
            start, end = m.span()
            run = m.group()
            if len(run) < 7 or run.isdigit() or sum(c.isdigit() for c in run) < 7 or text[end:end + 1].isalnum():
                continue  # too short for a phone, or one run of digits (masked as an order id from 7 digits)
            if all(taken[start + i] for i, c in enumerate(run) if c.isdigit()):
                continue  # already masked as something else (a card, an IBAN)
            for s, e in self.find(run):
                yield start + s, start + e

    def _find(self, run: str) -> tuple[tuple[int, int], ...]:
        """(start, end) of the phone numbers in one run of digit groups, tried region by region."""
        found: dict[tuple[int, int], None] = {}
        digits = sum(c.isdigit() for c in run)
        tries: list[tuple[str, phonenumbers.Leniency]] = []
        if "+" in run:
            tries.append(("ZZ", phonenumbers.Leniency.POSSIBLE))
        tries += [(r, phonenumbers.Leniency.POSSIBLE) for r in self._nanp]
        tries += [(r, phonenumbers.Leniency.STRICT_GROUPING) for r in self.regions if digits >= self._min_digits[r]]
        for region, leniency in tries:
            for m in phonenumbers.PhoneNumberMatcher(run, region, leniency=leniency):
                if self._keep(m, region, leniency):
                    found[(m.start, m.end)] = None
            if sum(sum(c.isdigit() for c in run[s:e]) for s, e in _disjoint(found)) >= digits:
                break  # every digit of the run is in a number already
        return tuple(_disjoint(found))

    @staticmethod
    def _keep(m: phonenumbers.PhoneNumberMatch, region: str, leniency: phonenumbers.Leniency) -> bool:
        raw = m.raw_string
        international = raw.lstrip("(").startswith("+")
        if "." in raw and re.search(r"[-/ ]", re.sub(r"^\+\d{1,3} ", "", raw)):
            return False  # dots mixed with other separators (after a "+33 "): decimals, not a phone
        if leniency == phonenumbers.Leniency.STRICT_GROUPING or (region == "ZZ" and international):
            return True
        if m.number.country_code != 1:
            return False
        groups = [len(g) for g in re.findall(r"\d+", raw)]
        if international or (len(groups) > 1 and re.match(r"\(?1\D", raw)):
            groups = groups[1:]  # "+1 ..." / "1-800-...": the country code or trunk prefix
        if groups in _NANP_GROUPS:
            return True
        if groups == [3, 4] and raw[0] in "23456789":
            exchange, line = (int(g) for g in re.findall(r"\d+", raw))
            return not (exchange % 10 == 0 and line % 10 == 0)
        return False


def check_phone_regions(regions: Sequence[str]) -> tuple[str, ...]:
    """``regions`` upper-cased, once each; a clear error naming any that ``phonenumbers`` does not know."""
    unknown = [r for r in regions if r.upper() not in phonenumbers.SUPPORTED_REGIONS]
    if unknown:
        raise ValueError(f"unknown phone region(s) {unknown}: give ISO 3166 country codes such as US, GB, FR, DE")
    return tuple(dict.fromkeys(r.upper() for r in regions))


def _disjoint(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The longest of overlapping spans, leftmost first."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(spans, key=lambda se: (se[0], -se[1])):
        if out and s < out[-1][1]:
            continue
        out.append((s, e))
    return out


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """A user's redaction regex; a clear error when it does not compile or matches empty text."""
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise ValueError(f"redaction pattern {pattern!r} is not a valid regular expression: {e}") from None
    if rx.fullmatch(""):
        raise ValueError(f"redaction pattern {pattern!r} matches empty text: it must match at least one character")
    return rx


# --- JSON fields ----------------------------------------------------------------------------------------------------

# JSON keys (lower-cased, without separators) whose values are personal data, whatever they look like
PERSONAL_KEYS: dict[str, Kind] = {
    **dict.fromkeys(["orderid", "ordernumber", "orderno", "ordernr", "orderref", "orderreference", "order",
                     "trackingnumber", "trackingid", "customerid", "customernumber", "accountid", "userid"],
                    "order_id"),
    **dict.fromkeys(["email", "emailaddress", "mail"], "email"),
    **dict.fromkeys(["phone", "phonenumber", "telephone", "tel", "mobile", "mobilenumber", "cell", "fax",
                     "contactnumber"], "phone"),
    **dict.fromkeys(["card", "cardnumber", "creditcard", "ccnumber"], "card"),
    **dict.fromkeys(["iban", "accountnumber", "bankaccount"], "iban"),
    **dict.fromkeys(["ssn", "socialsecuritynumber", "nationalid", "taxid", "passport", "passportnumber"], "ssn"),
}
_JSON_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\.)*"')
_JSON_NUMBER_VALUE = re.compile(r"\s*:\s*(-?\d+)")
_JSON_KEY_END = re.compile(r"\s*:")


@dataclass
class _Piece:
    """A part of one field's text: plain text, or one string literal of a JSON text (held decoded)."""

    text: str
    literal: str | None = None          # the JSON string literal as written; None: plain text
    decoded: str | None = None          # what that literal holds, before normalisation
    key_kind: Kind | None = None        # a JSON value whose key names personal data
    forced: list[tuple[int, int, Kind]] = field(default_factory=list)   # spans masked whatever they look like

    def written(self, masked: str) -> str:
        if self.literal is None:
            return masked
        if masked == self.decoded:
            return self.literal  # unchanged: the reply keeps its exact bytes
        return json.dumps(masked, ensure_ascii="\\u" in self.literal)


def _pieces(text: str) -> list[_Piece]:
    """``text`` normalised, split so that a JSON text's string literals are matched as the strings they hold."""
    if not text.lstrip().startswith(("{", "[")):
        return [_Piece(normalise(text))]
    pieces: list[_Piece] = []
    pending: Kind | None = None   # the kind of the key just read, for the value that follows
    pos = 0
    for m in _JSON_STRING.finditer(text):
        gap = text[pos:m.start()]
        if gap:
            pieces.append(_gap_piece(gap, pending))
            pending = None if gap.strip(" \t\r\n:") else pending
        try:
            decoded = json.loads(m.group()) if "\\" in m.group() else m.group()[1:-1]
        except ValueError:
            pieces.append(_Piece(normalise(m.group())))
            pos = m.end()
            continue
        is_key = bool(_JSON_KEY_END.match(text, m.end()))
        pieces.append(_Piece(normalise(decoded), literal=m.group(), decoded=decoded,
                             key_kind=None if is_key else pending))
        pending = PERSONAL_KEYS.get(_alnum(decoded).lower()) if is_key else None
        pos = m.end()
    if pos < len(text):
        pieces.append(_gap_piece(text[pos:], pending))
    return pieces


def _gap_piece(gap: str, pending: Kind | None) -> _Piece:
    piece = _Piece(normalise(gap))
    if pending is not None:
        m = _JSON_NUMBER_VALUE.match(piece.text)
        if m and len(m.group(1).lstrip("-")) >= 4:
            piece.forced.append((*m.span(1), pending))
    return piece


def _personal_value(value: str, kind: Kind) -> bool:
    """A JSON value under a personal key is masked when it could be an id: 4+ letters/digits with a digit
    ("unknown" or "n/a" are not masked), or an address with "@"."""
    if kind == "email" or "@" in value:
        return "@" in value
    return sum(c.isalnum() for c in value) >= 4 and any(c.isdigit() for c in value)


# --- the redactor ---------------------------------------------------------------------------------------------------

def _key_bytes(key: bytes | str | None) -> bytes:
    if key is None:
        return os.urandom(32)
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if not raw:
        raise ValueError("redact_key must not be empty (leave it unset for a random key per writer)")
    return hashlib.blake2b(raw, digest_size=32, person=b"cartspec-rkey").digest()


_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_SEPARATORS = frozenset(" .-/()")
_MAX_CHAIN = 40  # values up to this many letters and digits are found by joining runs; longer ones by a regex


def _joins(gap: str) -> bool:
    """Whether two runs of letters and digits with ``gap`` between them can be one value (``555-123``)."""
    return len(gap) <= 3 and _SEPARATORS.issuperset(gap)


def _value_key(value: str, kind: Kind) -> str:
    """What makes two spellings one value: an e-mail case-folded; anything else its letters and digits,
    upper-cased (``555-123-4567`` and ``5551234567`` are one value)."""
    if kind == "email":
        return value.casefold()
    if value.isascii():
        return "".join(c for c in value if c.isalnum()).upper() if not value.isalnum() else value.upper()
    return "".join(c.upper() if len(c.upper()) == 1 else c for c in value if c.isalnum())


class Redactor:
    """Masks personal data in a record, the same value by the same pseudonym in every field.

    By default (``defaults``) it masks e-mail addresses, phone numbers of ``phone_regions`` (and any in
    international form), card numbers (Luhn), IBANs (mod 97), US SSNs, Spanish DNI/NIE, Italian codici
    fiscali, French NIR, Aadhaar numbers, order ids and the values of JSON fields named like personal data;
    ``patterns`` adds regexes. A user pattern masks its whole match, or only its named group ``v`` when it
    has one (``r"cust(?P<v>\\d+)"`` keeps the prefix). Names and street addresses are not masked.

    The pseudonym of a value depends on its letters and digits (upper-cased, separators ignored) and on
    ``key``: the same key gives the same pseudonyms in every record and every file; without a key each
    ``Redactor`` draws a random one. Thread-safe.
    """

    def __init__(self, patterns: Sequence[str] = (), defaults: bool = True, *, key: bytes | str | None = None,
                 phone_regions: Sequence[str] = DEFAULT_PHONE_REGIONS):
        self.defaults = defaults
        self.patterns: list[_Pattern] = list(ORDER_IDS) if defaults else []
        self.patterns += [_Pattern("user", compile_pattern(p)) for p in patterns]
        self.phones = _Phones(phone_regions)
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
        """The same-shape stand-in for ``value`` (``user-1a2b3c@example.com`` for an e-mail); never ``value``
        itself, whatever its case or separators."""
        if kind == "email":
            folded = value.casefold()
            for attempt in range(1000):
                digest = hashlib.blake2b(folded.encode() + b"\0" * attempt, key=self._key, digest_size=3).hexdigest()
                if f"user-{digest}@example.com" != folded:
                    break
            return f"user-{digest}@example.com"
        norm = _value_key(value, "order_id")
        if not norm:
            return "x" * len(value)  # a user pattern matched only punctuation: nothing of it to keep
        attempt = 0
        while True:  # a one-digit value has 9 stand-ins, so this ends; longer ones differ at the first try
            out = self._shape(value, self._stream(norm + "\0" * attempt, len(value)))
            if _value_key(out, "order_id") != norm:
                return out
            attempt += 1

    @staticmethod
    def _shape(value: str, stream: bytes) -> str:
        out, i, prev_digit = [], 0, False
        for c in value:
            if not c.isalnum():
                out.append(c)
                continue
            b = stream[i]
            i += 1
            if c.isdigit():
                # the first digit of a number stays non-zero when it was, so "12345678" stays an 8-digit number;
                # separators do not count, so "555-123-4567" and "5551234567" get the same digits
                out.append(str(1 + b % 9) if not prev_digit and c != "0" else str(b % 10))
                prev_digit = True
            else:
                letter = _LETTERS[b % 26]
                out.append(letter.lower() if c.islower() else letter)
                prev_digit = False
        return "".join(out)

    # -- finding --
    def _detect(self, text: str, pieces: list[_Piece], starts: list[int]) -> list[tuple[int, int, Kind]]:
        """The spans of ``text`` (the pieces joined by NULs, which no finder crosses) that are personal data by
        their look or their JSON key; earlier finders win overlaps: forced JSON numbers, e-mails, cards / IBANs
        / ids, phones, order ids, the user's patterns (cut at piece ends), then whole JSON values whose key
        names personal data and in which nothing else was found."""
        taken = bytearray(len(text))
        spans: list[tuple[int, int, Kind]] = []

        def take(start: int, end: int, kind: Kind) -> None:
            if end > start and not any(taken[start:end]):
                taken[start:end] = b"\1" * (end - start)
                spans.append((start, end, kind))

        for piece, at in zip(pieces, starts):
            for s, e, k in piece.forced:
                take(at + s, at + e, k)
        if self.defaults:
            for s, e in EMAIL.spans(text):
                take(s, e, "email")
            for checked in CHECKED:
                for s, e in checked.spans(text):
                    take(s, e, checked.kind)
        if self.defaults:
            for s, e in self.phones.spans(text, taken):
                take(s, e, "phone")
        for pat in self.patterns:
            if pat.kind != "user":
                for s, e in pat.spans(text):
                    take(s, e, pat.kind)
        for pat in self.patterns:
            if pat.kind == "user":
                for s, e in pat.spans(text):
                    i = bisect.bisect_right(starts, s) - 1
                    while i < len(pieces) and starts[i] < e:  # one span per piece it touches
                        take(max(s, starts[i]), min(e, starts[i] + len(pieces[i].text)), "user")
                        i += 1
        if self.defaults:
            for piece, at in zip(pieces, starts):
                if piece.key_kind is None or any(taken[at:at + len(piece.text)]):
                    continue
                stripped = piece.text.strip()
                if _personal_value(stripped, piece.key_kind):
                    s = at + piece.text.index(stripped)
                    take(s, s + len(stripped), "email" if "@" in stripped else piece.key_kind)
        return spans

    # -- replacing --
    @staticmethod
    def _occurrences(text: str, values: dict[str, Kind]) -> list[tuple[int, int, Kind]]:
        """Every place in ``text`` where a masked value is written: its letters and digits in order, case
        ignored, in whole runs of letters and digits separated by at most three of ``space . - / ( )``."""
        found: list[tuple[int, int, Kind]] = []
        emails = [v for v, k in values.items() if k == "email"]
        if emails:
            rx = re.compile(r"(?<![\w.%+-])(?:" + "|".join(map(re.escape, sorted(emails, key=len, reverse=True)))
                            + r")(?!\w)", re.I)
            found += [(m.start(), m.end(), "email") for m in rx.finditer(text)]
        long = [v for v, k in values.items() if k != "email" and len(v) > _MAX_CHAIN]
        for v in long:  # rare (a user pattern's long match): one regex each, separators allowed between chars
            rx = re.compile(r"(?<![^\W_])" + "[ .()/-]{0,3}".join(map(re.escape, v)) + r"(?![^\W_])", re.I)
            found += [(m.start(), m.end(), values[v]) for m in rx.finditer(text)]
        longest = max((len(v) for v, k in values.items() if k != "email" and len(v) <= _MAX_CHAIN), default=0)
        if not longest:
            return found
        runs = [(m.start(), m.end(), _value_key(m.group(), "order_id")) for m in _ALNUM_RUN.finditer(text)]
        for a, (start, _, key) in enumerate(runs):
            b = a
            while len(key) <= longest:
                kind = values.get(key)
                if kind is not None and kind != "email":
                    found.append((start, runs[b][1], kind))
                b += 1
                if b == len(runs) or not _joins(text[runs[b - 1][1]:runs[b][0]]):
                    break
                key += runs[b][2]
        return found

    def _redact_fields(self, fields: list[str]) -> tuple[list[str], int]:
        """Every field normalised and masked; a value masked in one field is masked in all of them."""
        per_field = [_pieces(f) for f in fields]
        pieces = [p for fp in per_field for p in fp]
        starts, at = [], 0
        for p in pieces:
            starts.append(at)
            at += len(p.text) + 1
        text = "\0".join(p.text for p in pieces)
        spans = self._detect(text, pieces, starts)
        values: dict[str, Kind] = {}
        for s, e, k in spans:
            values.setdefault(_value_key(text[s:e], k) or text[s:e], k)
        taken = bytearray(len(text))
        for s, e, _ in spans:
            taken[s:e] = b"\1" * (e - s)
        for s, e, k in sorted(self._occurrences(text, values), key=lambda t: (t[0], -t[1])):
            if not any(taken[s:e]):
                taken[s:e] = b"\1" * (e - s)
                spans.append((s, e, k))
        spans.sort()
        memo: dict[tuple[str, str], str] = {}
        written: list[str] = []
        i = k = 0   # the next span, the next piece
        for fp in per_field:
            chunks = []
            for piece in fp:
                pos, pe = starts[k], starts[k] + len(piece.text)
                k += 1
                masked = []
                while i < len(spans) and spans[i][0] < pe:
                    s, e, kind = spans[i]
                    value = text[s:e]
                    if (value, kind) not in memo:
                        memo[value, kind] = self.pseudonym(value, kind)
                    masked += [text[pos:s], memo[value, kind]]
                    pos = e
                    i += 1
                masked.append(text[pos:pe])
                chunks.append(piece.written("".join(masked)))
            written.append("".join(chunks))
        return written, len(spans)

    # -- public --
    def redact_text(self, text: str) -> tuple[str, int]:
        """``text`` normalised with every value masked, and how many spans were masked."""
        if not text:
            return text, 0
        (masked,), n = self._redact_fields([text])
        return masked, n

    def redact_record(self, rec: RecordT) -> RecordT:
        """A copy of ``rec`` with its query, history, messages (every value but ``role``) and reply normalised
        and masked, each value by one pseudonym throughout; ``redactions`` counts the spans masked (added to
        what it already counted)."""
        msg_keys = [[k for k, v in m.items() if k != "role" and isinstance(v, str)] for m in rec.messages]
        fields = [rec.query, *(t.content for t in rec.history), *(m[k] for m, ks in zip(rec.messages, msg_keys)
                                                                   for k in ks), rec.reply]
        masked, count = self._redact_fields(fields)
        it = iter(masked)
        query = next(it)
        history = [Turn(role=t.role, content=next(it)) for t in rec.history]
        messages = [{**m, **{k: next(it) for k in ks}} for m, ks in zip(rec.messages, msg_keys)]
        reply = next(it)
        return rec.model_copy(update={"query": query, "history": history, "messages": messages, "reply": reply,
                                      "redactions": rec.redactions + count})
