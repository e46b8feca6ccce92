"""A pairwise LLM judge of speculative replies against the baseline's, and its calibration.

Protocol: every pair is judged twice, once with the candidate's reply as answer A and once as answer B.
The judge answers one letter (A, B, or C for "equally good"): the request asks for a single token with
its top log-probabilities, and the likeliest of A/B/C among them is the answer (the text when the server
sends no log-probabilities). The candidate wins only when both orders name it, loses only when both name
the baseline's reply; anything else (an explicit C, or orders that disagree) is a tie. Identical replies
are ties without asking. Win / tie / loss per deployment, with an exact sign test on wins vs losses.

Calibration: known-answer pairs built from gold answers: the gold reply against a corrupted copy (a price
bound changed, a brand exclusion dropped, a colour swapped, a wrong refund window, a wrong order id) must
be won by gold, and a gold reply against itself must be a tie. Accuracy, position consistency and tie
rate are reported beside every verdict; below 80% accuracy the judge is marked unreliable and the
verdict rests on the structured tests.

Modes: ``plain`` (request and the two replies) and ``reference`` (the gold answer in the prompt too).
The judge is any OpenAI-compatible endpoint, or a local vLLM deployment of a model cartspec has
(default ``base``: SmolLM2-135M-Instruct, the commerce model's base).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from ..task.data import Request

if TYPE_CHECKING:
    from .models import JudgeCalibration, Pair, QualityReport

MODES = ("plain", "reference")
RELIABLE_ACCURACY = 0.80
LETTERS = ("A", "B", "C")
JUDGE_SYSTEM = "You are a strict, careful judge of a shopping assistant's answers."
WHAT = {"search": "the shopper's product search parameters as JSON (every constraint the shopper stated, "
                  "nothing invented)",
        "support": "a correct answer to the shopper's support question as JSON (topic, order number if given, "
                   "and the shop's policy)"}


@dataclass
class JudgeSetup:
    """Which judge, how. ``url`` None: start ``model`` (default ``base``) with vLLM for the duration."""

    url: str | None = None
    model: str | None = None
    api_key_env: str | None = None
    mode: str = "plain"
    limit: int = 48  # differing pairs judged per deployment and temperature
    calibration_per_kind: int = 8
    concurrency: int = 8
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"judge mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.limit < 1 or self.calibration_per_kind < 1:
            raise ValueError("judge limit and calibration pairs per kind must be >= 1")


# --- prompts and answers ---------------------------------------------------------------------


def judge_messages(req: Request, first: str, second: str, reference: str | None = None) -> list[dict[str, str]]:
    """The judge's prompt for one order of one pair; ``reference``: the gold answer (reference mode)."""
    lines = [f"The assistant must give {WHAT[req.task]}."]
    for t in req.history:
        lines.append(f"Earlier {t.role}: {t.content}")
    lines.append(f"Shopper: {req.query}")
    if reference is not None:
        lines.append(f"Correct answer: {reference}")
    lines += [f"Answer A: {first.strip()}", f"Answer B: {second.strip()}",
              "Which answer is more correct" + (", compared with the correct answer" if reference else "") +
              "? Reply with one letter: A, B, or C if they are equally good."]
    return [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": "\n".join(lines)}]


def read_choice(raw: dict[str, Any], text: str) -> str | None:
    """A, B or C from one completion: the likeliest of them among the first token's top log-probabilities,
    else the reply's first letter; None when the judge said none of them."""
    try:
        content = (raw["choices"][0].get("logprobs") or {}).get("content") or []
    except (KeyError, IndexError, TypeError, AttributeError):
        content = []
    if content:
        best, best_lp = None, float("-inf")
        for cand in content[0].get("top_logprobs") or [content[0]]:
            tok = str(cand.get("token", "")).strip().upper()
            if tok in LETTERS and cand.get("logprob", float("-inf")) > best_lp:
                best, best_lp = tok, cand["logprob"]
        if best:
            return best
    head = text.strip().upper()[:1]
    return head if head in LETTERS else None


def combine(pick_cand_first: str | None, pick_cand_second: str | None) -> tuple[str, bool]:
    """(outcome for the candidate, position-consistent?) from the two orders' answers: in the first the
    candidate is A, in the second B. Both orders must agree for a win or a loss; otherwise a tie."""
    def who(pick: str | None, cand: str) -> str:
        if pick == cand:
            return "win"
        if pick in ("A", "B"):
            return "loss"
        return "tie"  # C, or no letter at all

    w1, w2 = who(pick_cand_first, "A"), who(pick_cand_second, "B")
    return (w1 if w1 == w2 else "tie"), w1 == w2


class JudgeFailed(RuntimeError):
    """The judge endpoint failed too many calls for its answers to mean anything."""


@dataclass
class Judged:
    outcome: str  # win | tie | loss, for the first reply ("candidate")
    consistent: bool
    picks: tuple[str | None, str | None]


async def judge_pairs(client: Any, items: list[tuple[Request, str, str, str | None]],
                      concurrency: int = 8) -> list[Judged]:
    """Judge ``(request, candidate, baseline, reference)`` items, each in both orders."""
    from ..serving.client import gather_limited

    def ask(msgs):
        async def one():
            c = await client.chat(msgs, max_tokens=1, temperature=0.0, extra={"logprobs": True, "top_logprobs": 10})
            return read_choice(c.raw, c.text)
        return one()

    coros = []
    for req, cand, base, ref in items:
        coros.append(ask(judge_messages(req, cand, base, ref)))
        coros.append(ask(judge_messages(req, base, cand, ref)))
    answers = await gather_limited(coros, concurrency)
    errors = [a for a in answers if isinstance(a, Exception)]
    if errors and len(errors) * 5 > len(answers):  # more than a fifth failed: not a judge's opinion
        raise JudgeFailed(f"{len(errors)} of {len(answers)} judge calls failed; first: {errors[0]}")
    out = []
    for i in range(len(items)):
        p1, p2 = answers[2 * i], answers[2 * i + 1]
        p1 = None if isinstance(p1, Exception) else p1
        p2 = None if isinstance(p2, Exception) else p2
        outcome, consistent = combine(p1, p2)
        out.append(Judged(outcome, consistent, (p1, p2)))
    return out


def judge_sync(make_client: Callable[[], Any], items: list[tuple[Request, str, str, str | None]],
               concurrency: int = 8) -> list[Judged]:
    """``judge_pairs`` from synchronous code, with a client opened (and closed) for the call."""
    async def go():
        async with make_client() as client:
            return await judge_pairs(client, items, concurrency)

    return asyncio.run(go()) if items else []


# --- calibration ----------------------------------------------------------------------------

COLOURS = ("red", "blue", "green", "black", "white", "pink", "grey", "brown")
CORRUPTIONS = ("price_changed", "brand_exclusion_dropped", "colour_swapped", "refund_window_wrong",
               "order_id_wrong")


def corrupt(kind: str, req: Request) -> str | None:
    """The request's gold reply with one known error of ``kind`` (canonical JSON), or None where the kind
    does not apply to it."""
    from ..task.schema import SCHEMAS, canonical_json

    if req.gold is None:
        return None
    g = SCHEMAS[req.task].model_validate(req.gold)
    if kind == "price_changed" and req.task == "search":
        if g.price_max is not None:
            return canonical_json(g.model_copy(update={"price_max": round(g.price_max * 2 + 10)}))
        if g.price_min is not None:
            return canonical_json(g.model_copy(update={"price_min": round(g.price_min / 2)}))
    if kind == "brand_exclusion_dropped" and req.task == "search" and g.brands_exclude:
        return canonical_json(g.model_copy(update={"brands_exclude": []}))
    if kind == "colour_swapped" and req.task == "search" and g.colors:
        other = next(c for c in COLOURS if c not in g.colors)
        return canonical_json(g.model_copy(update={"colors": sorted([other, *g.colors[1:]])}))
    if kind == "refund_window_wrong" and req.task == "support" and g.topic == "refund_window" and "30 days" in g.reply:
        return canonical_json(g.model_copy(update={"reply": g.reply.replace("30 days", "90 days")}))
    if kind == "order_id_wrong" and req.task == "support" and g.order_id:
        wrong = g.order_id[:-1] + ("7" if g.order_id[-1] != "7" else "3")
        return canonical_json(g.model_copy(update={"order_id": wrong, "reply": g.reply.replace(g.order_id, wrong)}))
    return None


def calibration_items(per_kind: int = 8) -> list[tuple[str, Request, str, str]]:
    """(kind, request, gold reply, other reply) known-answer pairs: ``per_kind`` of each corruption and as
    many identical pairs (gold against itself), from the generated dev and test splits."""
    from ..task.generator import generate
    from ..task.schema import SCHEMAS, canonical_json

    pool = [r for r in generate("test", 400) + generate("dev", 200) if r.gold is not None]
    out: list[tuple[str, Request, str, str]] = []
    for kind in CORRUPTIONS:
        got = 0
        for r in pool:
            bad = corrupt(kind, r)
            if bad is None:
                continue
            gold = canonical_json(SCHEMAS[r.task].model_validate(r.gold))
            if bad == gold:
                continue
            out.append((kind, r, gold, bad))
            got += 1
            if got == per_kind:
                break
    for i, r in enumerate(pool[: per_kind]):  # identical pairs: search and support as the pool mixes them
        gold = canonical_json(SCHEMAS[r.task].model_validate(r.gold))
        out.append(("identical", r, gold, gold))
    return out


def calibrate(make_client: Callable[[], Any], setup: JudgeSetup) -> "JudgeCalibration":
    """Judge the known-answer pairs (gold as the first reply, "candidate"): gold must win, identical tie."""
    from .models import JudgeCalibration

    items = calibration_items(setup.calibration_per_kind)
    ref = setup.mode == "reference"
    judged = judge_sync(make_client, [(r, gold, other, gold if ref else None) for _, r, gold, other in items],
                        setup.concurrency)
    right: dict[str, list[bool]] = {}
    ties_on_corrupted = []
    for (kind, *_), j in zip(items, judged):
        expected = "tie" if kind == "identical" else "win"
        right.setdefault(kind, []).append(j.outcome == expected)
        if kind != "identical":
            ties_on_corrupted.append(j.outcome == "tie")
    flat = [x for v in right.values() for x in v]
    acc = sum(flat) / len(flat)
    return JudgeCalibration(mode=setup.mode, n=len(items), accuracy=acc,
                            position_consistency=sum(j.consistent for j in judged) / len(judged),
                            tie_rate=sum(ties_on_corrupted) / max(len(ties_on_corrupted), 1),
                            reliable=acc >= RELIABLE_ACCURACY,
                            by_kind={k: sum(v) / len(v) for k, v in right.items()})


# --- the endpoint ---------------------------------------------------------------------------


@contextlib.contextmanager
def judge_endpoint(setup: JudgeSetup, log_dir: Path) -> Iterator[Any]:
    """The judge's endpoint: the URL given (checked now: unreachable fails at once), or a local vLLM."""
    from ..serving.endpoint import EndpointError, api_key_from_env, endpoint
    from ..serving.spec import DeploymentSpec

    key = api_key_from_env(setup.api_key_env)
    if setup.url:
        with endpoint(setup.url, log_dir=log_dir, api_key=key, served_name=setup.model) as ep:
            if not ep.alive():
                raise EndpointError(f"the judge endpoint {setup.url} does not answer: {ep.died_reason()}")
            yield ep
        return
    spec = DeploymentSpec(name="judge", model=setup.model or "base", enforce_eager=True, max_model_len=2048,
                          max_num_seqs=16).resolved()
    with endpoint(spec, log_dir=log_dir, api_key=key) as ep:
        yield ep


def run_judge(setup: JudgeSetup, report: "QualityReport", pairs: dict[tuple[str, float, str], list["Pair"]],
              gold: dict[tuple[str, str], Request], run_dir: Path, log: Callable[[str], None] = print) -> None:
    """Calibrate the judge, then judge each entry's pairs; fills ``report`` in place."""
    from ..serving.client import ChatClient
    from ..task.schema import SCHEMAS, canonical_json
    from .paired import sign_test
    from .models import JudgeResult

    with judge_endpoint(setup, Path(run_dir) / "logs") as ep:
        report.judge = {"url": setup.url or "local", "model": ep.served_name if setup.url else (setup.model or "base"),
                        "mode": setup.mode, **({"api_key_env": setup.api_key_env} if setup.api_key_env else {})}

        def client() -> ChatClient:
            return ChatClient(ep.url, ep.served_name, timeout=setup.timeout_s, api_key=ep.api_key)

        log(f"judge {report.judge['model']} ({setup.mode}): calibrating on known-answer pairs")
        cal = calibrate(client, setup)
        report.calibrations[setup.mode] = cal
        log(f"judge calibration: accuracy {cal.accuracy:.1%}, position consistency {cal.position_consistency:.1%}, "
            f"tie rate {cal.tie_rate:.1%}")
        for e in report.entries:
            seen: dict[tuple[str, int], Any] = {}
            for p in pairs.get((e.deployment, e.temperature, e.request_set), []):
                if (e.request_set, p.request_id) in gold:
                    seen.setdefault((p.request_id, p.sample), p)
            same = [p for p in seen.values() if p.candidate == p.baseline]
            differ = sorted((p for p in seen.values() if p.candidate != p.baseline),
                            key=lambda p: (p.request_id, p.sample))[: setup.limit]
            items = []
            for p in differ:
                req = gold[(e.request_set, p.request_id)]
                ref = canonical_json(SCHEMAS[req.task].model_validate(req.gold)) if setup.mode == "reference" else None
                items.append((req, p.candidate, p.baseline, ref))
            judged = judge_sync(client, items, setup.concurrency)
            by_task: dict[str, dict[str, int]] = {}
            for p in same:
                t = by_task.setdefault(gold[(e.request_set, p.request_id)].task, {"win": 0, "tie": 0, "loss": 0})
                t["tie"] += 1
            for (req, *_), j in zip(items, judged):
                by_task.setdefault(req.task, {"win": 0, "tie": 0, "loss": 0})[j.outcome] += 1
            win = sum(j.outcome == "win" for j in judged)
            loss = sum(j.outcome == "loss" for j in judged)
            tie = len(same) + sum(j.outcome == "tie" for j in judged)
            e.judge = JudgeResult(model=report.judge["model"], mode=setup.mode, win=win, tie=tie, loss=loss,
                                  judged=len(judged), pairs=len(seen), p_value=sign_test(win, loss),
                                  by_task=by_task, calibration=cal)
            log(f"judge {e.deployment} T={e.temperature:g}: {win} wins, {tie} ties, {loss} losses "
                f"({len(judged)} judged, {len(same)} identical)")
