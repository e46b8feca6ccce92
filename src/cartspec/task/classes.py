"""Token classes of a reply, for acceptance by class.

* ``json_structure``: braces, brackets, colons, commas, quotes, whitespace between
  them, and the end-of-turn token of a JSON reply;
* ``json_key``: characters of an object key;
* ``value_copied``: characters of a value (string, number) whose word appears in
  the request (query and history, case-insensitive), e.g. ``"denim jacket"``
  for "any red denim jacket";
* ``value_not_in_request``: value characters the model has to produce itself
  (``"clothing"``, enum values, normalised spellings, ``true``);
* ``free_text``: prose: the ``reply`` field of support answers, and every token
  of a reply that is not a JSON object.

A token takes the class of its first character that is not structure (``"size``
is a key token); a token of structure characters only is structure.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

CLASSES = ("json_structure", "json_key", "value_copied", "value_not_in_request", "free_text")
FREE_TEXT_KEYS = {"reply", "message", "answer", "text"}
_WORD = re.compile(r"[A-Za-z0-9]+")


class _Scanner:
    def __init__(self, text: str, request: str):
        self.t = text
        self.req = request.lower()
        self.lab = ["free_text"] * len(text)
        self.i = 0

    def ws(self) -> None:
        while self.i < len(self.t) and self.t[self.i].isspace():
            self.lab[self.i] = "json_structure"
            self.i += 1

    def struct(self, ch: str) -> None:
        if self.i >= len(self.t) or self.t[self.i] != ch:
            raise ValueError(f"expected {ch!r} at {self.i}")
        self.lab[self.i] = "json_structure"
        self.i += 1

    def string(self) -> tuple[int, int]:
        self.struct('"')
        start = self.i
        while self.i < len(self.t) and self.t[self.i] != '"':
            self.i += 2 if self.t[self.i] == "\\" else 1
        end = min(self.i, len(self.t))
        if self.i < len(self.t):
            self.struct('"')
        return start, end

    def label_value(self, start: int, end: int, key: str | None) -> None:
        text = self.t[start:end]
        if key in FREE_TEXT_KEYS:
            cls_all = "free_text"
        elif text.strip() and text.strip().lower() in self.req:
            cls_all = "value_copied"
        else:
            cls_all = None
        if cls_all:
            for k in range(start, end):
                self.lab[k] = cls_all
            return
        for k in range(start, end):
            self.lab[k] = "value_not_in_request"
        for m in _WORD.finditer(text):
            if m.group().lower() in self.req:
                for k in range(start + m.start(), start + m.end()):
                    self.lab[k] = "value_copied"

    def value(self, key: str | None) -> None:
        self.ws()
        if self.i >= len(self.t):
            return
        c = self.t[self.i]
        if c == "{":
            self.obj()
        elif c == "[":
            self.struct("[")
            self.ws()
            if self.i < len(self.t) and self.t[self.i] == "]":
                self.struct("]")
                return
            while self.i < len(self.t):
                self.value(key)
                self.ws()
                if self.i < len(self.t) and self.t[self.i] == ",":
                    self.struct(",")
                    continue
                self.struct("]")
                return
        elif c == '"':
            s, e = self.string()
            self.label_value(s, e, key)
        else:
            s = self.i
            while self.i < len(self.t) and self.t[self.i] not in ",}] \n\t\r":
                self.i += 1
            self.label_value(s, self.i, key)

    def obj(self) -> None:
        self.struct("{")
        self.ws()
        if self.i < len(self.t) and self.t[self.i] == "}":
            self.struct("}")
            return
        while self.i < len(self.t):
            self.ws()
            s, e = self.string()
            for k in range(s, e):
                self.lab[k] = "json_key"
            key = self.t[s:e]
            self.ws()
            self.struct(":")
            self.value(key)
            self.ws()
            if self.i < len(self.t) and self.t[self.i] == ",":
                self.struct(",")
                continue
            self.struct("}")
            return


def char_classes(text: str, request_text: str) -> tuple[list[str], bool]:
    """A class per character of ``text``; and whether it is (the start of) a JSON object."""
    sc = _Scanner(text, request_text)
    sc.ws()
    if sc.i >= len(text) or text[sc.i] != "{":
        return ["free_text"] * len(text), False
    try:
        sc.value(None)
    except ValueError:
        # malformed: what was scanned keeps its labels, the rest stays free text
        pass
    sc.ws()
    return sc.lab, True


def request_text(req: Any) -> str:
    """What the shopper wrote: history turns and the query."""
    parts = [t.content for t in getattr(req, "history", [])] + [req.query]
    return "\n".join(parts)


def token_classes(tokenizer: Any, token_ids: Sequence[int], request: str) -> list[str]:
    """The class of each output token (see module doc)."""
    ids = list(token_ids)
    spans = []
    prev = ""
    for k in range(len(ids)):
        cur = tokenizer.decode(ids[:k + 1], skip_special_tokens=True)
        if not cur.startswith(prev):  # a multi-byte character completed: re-anchor
            common = 0
            while common < min(len(cur), len(prev)) and cur[common] == prev[common]:
                common += 1
            spans.append((common, len(cur)))
        else:
            spans.append((len(prev), len(cur)))
        prev = cur
    labels, is_json = char_classes(prev, request)
    out = []
    for s, e in spans:
        if e <= s:
            out.append("json_structure" if is_json else "free_text")
            continue
        cls = "json_structure"
        for k in range(s, e):
            if labels[k] != "json_structure":
                cls = labels[k]
                break
        out.append(cls)
    return out
