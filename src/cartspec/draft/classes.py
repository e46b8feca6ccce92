"""Token classes of a reply: they live in ``task.classes`` (a reply's classes are the task's, read by the
drafting, analysis and report stages alike); this module keeps the old import path working."""

from ..task.classes import CLASSES, FREE_TEXT_KEYS, char_classes, request_text, token_classes

__all__ = ["CLASSES", "FREE_TEXT_KEYS", "char_classes", "request_text", "token_classes"]
