"""Personal data in every supported format, in queries, history, messages and replies (free text and JSON
fields), written through the real TrafficWriter: none of it may reach the written files, and the same value
gets one pseudonym in every field. Also what must stay unmasked in the commerce task (prices, sizes, years)."""

from __future__ import annotations

import json
import re
import threading
import unicodedata

import pytest

from cartspec.task.data import Turn
from cartspec.task.redact import Redactor, normalise
from cartspec.task.traffic import TrafficConfig, TrafficRecord, TrafficWriter, read_traffic, traffic_files

# format -> values written the way people write them (each one a real-looking, checksum-valid value)
CORPUS: dict[str, list[str]] = {
    "e-mail": ["jane.doe+shop@gmail.com", "J_Smith@mail.example.co.uk", "jürgen.müller@beispiel.de",
               "用户@例子.广告", "ｊａｎｅ＠ｓｈｏｐ．ｃｏｍ"],
    "phone, international": ["+44 20 7946 0958", "+1 (555) 123-4567", "+49-30-1234567", "+33 1 23 45 67 89",
                             "+91 98765 43210", "0044 20 7946 0958", "0049 171 1234567"],
    "phone, national GB": ["020 7946 0958", "07700 900123", "0207 946 0958"],
    "phone, national FR": ["01 23 45 67 89", "06 12 34 56 78"],
    "phone, national US": ["555-1234", "(555) 123-4567", "555-123-4567", "555.123.4567", "1-800-555-1234"],
    "phone, national DE/ES/IT/IN": ["030 1234567", "0171 1234567", "612 345 678", "02 1234 5678", "98765 43210"],
    "card (Luhn)": ["4111 1111 1111 1111", "4111-1111-1111-1111", "4111111111111111", "3782 822463 10005",
                    "378282246310005", "5555 5555 5555 4444"],
    "IBAN (mod 97)": ["GB82 WEST 1234 5698 7654 32", "GB82WEST12345698765432", "DE89 3704 0044 0532 0130 00",
                      "FR14 2004 1010 0505 0001 3M02 606", "NL91ABNA0417164300"],
    "US SSN": ["536-22-1234", "219 45 6789"],
    "national id (ES, IT, FR, IN)": ["12345678Z", "X1234567L", "RSSMRA85T10A562S", "2 55 08 14 168 025 38",
                                     "2345 6789 0124"],
    "order id": ["AB12345", "#552914", "ORD-2024-00123", "W123-4567", "48213377", "order no. 98765"],
    "non-ASCII digits": ["٠٢٠ ٧٩٤٦ ٠٩٥٨", "४१११ ११११ ११११ ११११", "＃５５２９１４", "order ４８２１３３７７",
                         "۵۵۵-۱۲۳-۴۵۶۷"],
}

# the JSON key each format's value sits under in a reply
KEYS = {"e-mail": "email", "card (Luhn)": "card_number", "IBAN (mod 97)": "iban", "US SSN": "ssn",
        "national id (ES, IT, FR, IN)": "national_id", "order id": "order_id", "non-ASCII digits": "order_id"}


def core(value: str) -> str:
    """The part of a corpus entry that is the personal value ("order no. 98765" -> "98765")."""
    return re.sub(r"^(?:order no\. |order )", "", value)


def leak_forms(value: str) -> set[str]:
    """What must not be in a written file: the value as given, normalised, JSON-escaped, and its bare digits
    (and letters) when it has enough of them to identify anything."""
    v = core(value)
    forms = {v, normalise(v), json.dumps(v)[1:-1], json.dumps(normalise(v))[1:-1]}
    bare = "".join(c for c in normalise(v) if c.isalnum())
    if sum(c.isdigit() for c in bare) >= 5:
        forms |= {bare, "".join(c for c in bare if c.isdigit())}
    if "@" in v:
        forms.add(normalise(v).split("@")[0])  # the local part alone
    return {f for f in forms if f}


def records_for(fmt: str, value: str, i: int) -> list[TrafficRecord]:
    """The value in a query (with its messages), in the history, and in a JSON reply: under a key naming it,
    in free text, both with ensure_ascii escapes and without; and once only in the reply."""
    key = KEYS.get(fmt, "phone")
    q = f"hi, it's about {value}, thanks"
    msgs = [{"role": "system", "content": "Answer the shopper."}, {"role": "user", "content": q}]
    base = dict(task="support", temperature=0.0, structured=True)
    out = []
    for ascii_only in (True, False):
        reply = json.dumps({"intent": "support", "topic": "order_status", key: core(value),
                            "reply": f"Noted: {value}."}, ensure_ascii=ascii_only)
        history = [Turn(role="user", content=f"my details: {value}"), Turn(role="assistant", content=reply)]
        out.append(TrafficRecord(id=f"q{i}{ascii_only}", ts=1000.0 + i, query=q, history=history, messages=msgs,
                                 reply=reply, **base))
    only_reply = json.dumps({"intent": "support", "topic": "contact", key: core(value), "reply": "Done."})
    out.append(TrafficRecord(id=f"r{i}", ts=2000.0 + i, query="what did you note?", messages=[], reply=only_reply,
                             **base))
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("traffic")
    with TrafficWriter(TrafficConfig(dir=d, redact_key="corpus")) as w:
        i = 0
        for fmt, values in CORPUS.items():
            for value in values:
                for rec in records_for(fmt, value, i):
                    w.write(rec)
                i += 1
    return "".join(f.read_text(encoding="utf-8") for f in traffic_files(d))


def leak_table(text: str) -> list[tuple[str, int, list[str]]]:
    table = []
    for fmt, values in CORPUS.items():
        leaked = [v for v in values if any(form in text for form in leak_forms(v))]
        table.append((fmt, len(values), leaked))
    return table


def test_no_value_of_the_corpus_is_written_in_any_form(written):
    table = leak_table(written)
    print("\n| format | values | leaked |\n|---|---|---|")
    for fmt, n, leaked in table:
        print(f"| {fmt} | {n} | {len(leaked)} |")
    print(f"| all | {sum(n for _, n, _ in table)} | {sum(len(x) for _, _, x in table)} |")
    assert {fmt: leaked for fmt, _, leaked in table if leaked} == {}


@pytest.mark.parametrize("fmt,value", [(f, v) for f, vs in CORPUS.items() for v in vs if "@" not in normalise(v)])
def test_each_value_is_masked_whole(fmt, value):
    """Not just part of it: "030 1234567" loses its area code too, "+44 20 ..." its country code."""
    r = Redactor(key="k")
    lead = "order" if value == "AB12345" else "about"  # a bare "AB12345" is an id only beside "order" (or a key)
    out, n = r.redact_text(f"{lead} {value}")
    v = normalise(core(value))
    if v.startswith("ORD-"):
        assert out == f"{lead} ORD-" + r.pseudonym(v[4:])   # the documented exception: the prefix is kept
    else:
        assert (out, n) == (f"{lead} {normalise(value)[:-len(v)]}{r.pseudonym(v)}", 1)


def test_the_leak_check_would_see_an_unmasked_value(tmp_path):
    """The corpus check can fail: with the finders off, every value is written as given."""
    with TrafficWriter(TrafficConfig(dir=tmp_path, redact_defaults=False)) as w:
        for rec in records_for("order id", "AB12345", 0):
            w.write(rec)
        text = "".join(f.read_text(encoding="utf-8") for f in traffic_files(tmp_path))
    assert any(form in text for form in leak_forms("AB12345"))


def test_every_record_of_the_corpus_is_written_and_counted(written, tmp_path):
    lines = [json.loads(line) for line in written.splitlines()]
    assert len(lines) == 3 * sum(len(v) for v in CORPUS.values())
    assert all(line["redactions"] >= 1 for line in lines)
    assert all(json.loads(line["reply"])["intent"] == "support" for line in lines)  # replies stay valid JSON


# --- one pseudonym per value, across the record ---------------------------------------------------------------

@pytest.mark.parametrize("query,value", [
    ("where is my order AB12345?", "AB12345"),          # the repro
    ("any update on #552914?", "552914"),
    ("my order is ORD-2024-00123", "2024-00123"),
])
def test_an_id_masked_in_the_query_is_masked_in_the_reply_fields_too(tmp_path, query, value):
    full = "ORD-2024-00123" if value.startswith("2024") else value
    reply = json.dumps({"topic": "order_status", "order_id": full, "text": f"Your order {full} ships today"},
                       separators=(",", ":"))
    with TrafficWriter(TrafficConfig(dir=tmp_path, redact_key="k")) as w:
        w.write(TrafficRecord(id="r", ts=1.0, task="support", query=query, messages=[{"role": "user",
                              "content": query}], reply=reply, temperature=0.0, structured=True))
    text = traffic_files(tmp_path)[0].read_text()
    assert value not in text and value.replace("-", "") not in text
    (back,) = read_traffic(tmp_path)
    fields = json.loads(back.reply)
    pseudo = fields["order_id"]
    assert pseudo != full and pseudo in back.query and f"Your order {pseudo} ships today" == fields["text"]
    assert back.messages[0]["content"] == back.query
    assert back.redactions == 4  # the query, the message, the reply's order_id and its text


def test_a_value_matched_by_no_finder_in_a_field_is_masked_there_as_elsewhere():
    """The history's assistant turn names only "AB12345" (no pattern matches a bare id in free text): it gets
    the pseudonym the query's "order AB12345" got; so do other spellings of the same phone number."""
    r = Redactor(key="k")
    rec = TrafficRecord(id="r", ts=1.0, task="support", query="order AB12345, call 555-123-4567",
                        history=[Turn(role="assistant", content="Is AB12345 the one? I'll ring 5551234567.")],
                        messages=[], reply='{"order_id": "ab12345", "phone": "(555) 123 4567"}',
                        temperature=0.0, structured=True)
    out = r.redact_record(rec)
    dump = out.model_dump_json()
    assert "12345" not in dump and "4567" not in dump
    oid = re.search(r"order (\w+),", out.query).group(1)
    phone = re.search(r"call ([\d-]+)", out.query).group(1)
    assert out.history[0].content == f"Is {oid} the one? I'll ring {phone.replace('-', '')}."
    assert json.loads(out.reply) == {"order_id": oid.lower(), "phone": f"({phone[:3]}) {phone[4:7]} {phone[8:]}"}


@pytest.mark.parametrize("reply,masked_key", [
    ('{"order_id": 552914, "price_max": 120}', "order_id"),      # a JSON number under a personal key
    ('{"orderId": "XK-99-1", "size": "10"}', "orderId"),          # camelCase, an id no pattern knows
    ('{"customer": {"Email": "a.b@c.io"}}', None),
])
def test_json_fields_named_like_personal_data_are_masked_whatever_they_hold(reply, masked_key):
    out, n = Redactor(key="k").redact_text(reply)
    before, after = json.loads(reply), json.loads(out)
    assert n == 1
    if masked_key:
        assert after[masked_key] != before[masked_key]
        assert type(after[masked_key]) is type(before[masked_key])  # a number stays a number
        assert {k: v for k, v in after.items() if k != masked_key} == \
            {k: v for k, v in before.items() if k != masked_key}   # prices and sizes kept
    else:
        assert after["customer"]["Email"].endswith("@example.com")


def test_json_values_that_are_not_ids_are_kept():
    reply = '{"order_id": "unknown", "email": "n/a", "phone": null, "order_number": "12"}'
    assert Redactor(key="k").redact_text(reply) == (reply, 0)


# --- normalisation --------------------------------------------------------------------------------------------

def test_non_ascii_digits_are_written_as_masked_ascii_digits():
    r = Redactor(key="k")
    for text, plain in [("order ٤٨٢١٣٣٧٧", "order 48213377"), ("order ４８２１３３７７", "order 48213377"),
                        ("call ۵۵۵-۱۲۳-۴۵۶۷", "call 555-123-4567")]:
        out, n = r.redact_text(text)
        assert n == 1 and out == r.redact_text(plain)[0]  # the same pseudonym as the ASCII spelling
        assert all(c.isascii() for c in out) and plain.split()[1] not in out


def test_the_written_text_is_nfkc_normalised():
    out, n = Redactor(key="k").redact_text("ﬁne ｓｈｏｅｓ, size ①⓪")
    assert (out, n) == (unicodedata.normalize("NFKC", "ﬁne ｓｈｏｅｓ, size ①⓪"), 0)


def test_a_masked_value_is_never_written_unchanged():
    r = Redactor(key="k")
    for value in [str(d) for d in range(10)] + [f"{n:04d}" for n in range(0, 10000, 7)] + ["a", "Z"]:
        assert r.pseudonym(value).upper() != value.upper()
    assert r.pseudonym("--") == "xx"


# --- what stays unmasked ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    "red boots under $120, size 10",
    "between 200-5000 usd",                 # a 3-4 range, not a local phone number
    "laptops 1200-5000, 49.99-199.99 dollars",
    "items 12 34 56 78 90, sizes 8 9 10 11 12 13",
    "released in 2024, the 2023-2024 season, 12/25/2024",
    "qty 3, 2 pairs, sku 4411, model 1200, 4.5 stars",
    "a $1,299.99 tv, 65 inch, 120hz",
    '{"intent": "search", "keywords": "running shoes", "price_max": 120, "size": "10", "year": 2024}',
])
def test_commerce_numbers_are_not_masked(text):
    assert Redactor(key="k").redact_text(text) == (text, 0)


def test_names_and_street_addresses_are_not_masked():
    """Documented: only the formats above are masked; a name or an address needs a --redact pattern."""
    text = "ship to Jane Doe, 221B Baker Street, London"
    assert Redactor(key="k").redact_text(text) == (text, 0)
    out, n = Redactor([r"Jane Doe", r"\d+\w? Baker Street"], key="k").redact_text(text)
    assert n == 2 and "Jane Doe" not in out and "Baker Street" not in out


def test_phone_regions_are_configurable_and_checked():
    assert Redactor(key="k", phone_regions=["US"]).redact_text("ring 020 7946 0958")[1] == 0  # a GB format
    assert Redactor(key="k", phone_regions=["GB"]).redact_text("ring 020 7946 0958")[1] == 1
    with pytest.raises(ValueError, match="unknown phone region.*'XX'"):
        TrafficConfig(dir=None, redact_phone_regions=["GB", "XX"])


# --- in the agent -------------------------------------------------------------------------------------------------

def test_the_agent_redacts_off_its_event_loop_and_records_the_repro_masked(tmp_path):
    from test_agent_app import FakeUpstream, make_client, post

    fake = FakeUpstream().start()
    fake.reply = lambda body: ('{"intent": "support", "topic": "order_status", "order_id": "AB12345", '
                               '"reply": "Your order AB12345 ships today"}')
    threads: list[str] = []
    try:
        with make_client(fake, tmp_path, traffic=TrafficConfig(dir=tmp_path / "traffic")) as c:
            agent = c.app.state.agent
            write = agent.traffic.write

            def spy(rec):
                threads.append(threading.current_thread().name)
                write(rec)

            agent.traffic.write = spy
            for _ in range(3):
                r = post(c, "/v1/support", {"query": "where is my order AB12345?"},
                         **{"cache-control": "no-cache"})
                assert r.status_code == 200 and r.json()["order_id"] == "AB12345"  # the shopper sees the real id
        text = "".join(f.read_text() for f in traffic_files(tmp_path / "traffic"))
        assert text and "AB12345" not in text
        assert threads and all(name.startswith("cartspec-traffic") for name in threads)
    finally:
        fake.stop()


def test_serve_help_says_what_recording_masks_and_what_it_does_not():
    from typer.testing import CliRunner

    from cartspec.cli import app

    res = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "400", "TERM": "dumb"})
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", res.output).split())
    assert res.exit_code == 0, res.output
    for said in ("e-mails, phone numbers, card numbers, IBANs, US SSNs", "order ids",
                 "NOT masked: names, street addresses"):
        assert said in text
