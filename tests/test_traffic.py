"""Recorded traffic: redaction before writing, rotation and pruning, torn-line repair, reading back,
and the dedupe / time split a refresh trains on."""

from __future__ import annotations

import json
import os
import re
import stat
import threading
import time
from pathlib import Path

import pytest

from cartspec.task.data import Turn
from cartspec.task.generator import generate
from cartspec.task.prompts import messages as task_messages
from cartspec.private_files import UnsafePathError
from cartspec.task.traffic import (
    Redactor,
    TrafficConfig,
    TrafficRecord,
    TrafficWriter,
    dedupe,
    process_id,
    read_traffic,
    repair_torn_tail,
    scan_traffic,
    split_by_time,
    traffic_files,
)

NAME = re.compile(r"^traffic-\d{8}T\d{6}-[0-9a-f]{16}(-\d+)?\.jsonl$")  # named by a random id per process
DEAD_PID = 999_999_999  # above any pid_max: an older version's file named after it was left by a process that is gone


def rec(i: int = 0, *, ts: float | None = None, task: str = "support", query: str | None = None,
        reply: str = '{"topic": "order_status"}', history: list[Turn] | None = None, **kw) -> TrafficRecord:
    query = query if query is not None else f"where is my package number {i}?"
    msgs = [{"role": "system", "content": "You answer shoppers."}, {"role": "user", "content": query}]
    return TrafficRecord(id=f"r{i}", ts=float(int(time.time())) if ts is None else ts, task=task, query=query,
                         history=history or [], messages=msgs, reply=reply, temperature=0.0, structured=True, **kw)


def shape(s: str) -> str:
    return re.sub(r"[A-Za-z]", "a", re.sub(r"\d", "9", s))


# --- redaction ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,value", [
    ("where is my order 48213377?", "48213377"),             # the task's numeric ids
    ("has order #48213377 shipped yet?", "48213377"),
    ("cancel w123-4567 please", "w123-4567"),                # the task's letter ids, lower-cased by capitalize()
    ("status of K905-2210", "K905-2210"),
    ("any update on #552914?", "552914"),                    # generic "#123456"
    ("my order is ORD-2024-00123", "2024-00123"),            # "ORD-..." keeps its prefix
    ("order no. 98765 is late", "98765"),
    ("order nr A1B2C3 is late", "A1B2C3"),
    ("tracking 5551234567890", "5551234567890"),             # any long run of digits
])
def test_default_order_ids_are_masked_in_shape(text, value):
    r = Redactor(key="k")
    out, n = r.redact_text(text)
    assert n == 1
    assert value not in out
    assert len(out) == len(text) and shape(out) == shape(text)  # digits -> digits, letters -> letters, separators kept
    start = text.index(value)
    masked = out[start:start + len(value)]
    assert masked != value and shape(masked) == shape(value)
    assert [c.islower() for c in masked] == [c.islower() for c in value]  # case kept
    if value.isdigit():
        assert masked[0] != "0"  # an 8-digit number stays an 8-digit number


def test_ord_prefix_kept():
    out, _ = Redactor(key="k").redact_text("my order is ORD-2024-00123")
    assert out.startswith("my order is ORD-") and "2024-00123" not in out


@pytest.mark.parametrize("text", [
    "email me at jane.doe+shop@gmail.com please",
    "Contact: J_Smith@mail.example.co.uk.",
])
def test_emails_become_a_fixed_shape(text):
    out, n = Redactor(key="k").redact_text(text)
    assert n == 1
    assert "@gmail" not in out and "J_Smith" not in out
    assert re.search(r"\buser-[0-9a-f]{6}@example\.com\b", out)


@pytest.mark.parametrize("phone", ["+1 (555) 123-4567", "+44 20 7946 0958", "+49-30-1234567", "(555) 123-4567",
                                   "555-123-4567", "555.123.4567", "555 123 4567",
                                   # national formats (phonenumbers): GB, GB mobile, GB from abroad, FR, US local
                                   "020 7946 0958", "07700 900123", "0044 20 7946 0958", "01 23 45 67 89",
                                   "555-1234"])
def test_phones_are_masked(phone):
    text = f"call me on {phone} tomorrow"
    out, n = Redactor(key="k").redact_text(text)
    assert n == 1 and phone not in out
    assert shape(out) == shape(text)


@pytest.mark.parametrize("text", [
    "size 10, under $120",
    "nike air max 90",
    "running shoes between 50-200 usd, 4.5 stars and up",
    "laptops 1200-5000, 49.99-199.99 dollars",
    "jpy 30000 or 10k max, size 42 eu",
    "sort by price low to high, order by rating",
    "sony wh-1000xm4 headphones, iphone 15 pro 256gb",
    "released 2024-01-05, ships in 3-5 days",
    "a 2 for $30 deal on 3 pairs, item 12 of 20",
    "we are #1 in shoes",
    "between 200-5000 usd, sizes 8 9 10 11 12 13",   # a range and a list, not phone numbers
])
def test_text_without_personal_data_is_unchanged(text):
    out, n = Redactor(key="k").redact_text(text)
    assert (out, n) == (text, 0)


def test_generated_traffic_masks_every_order_id_and_nothing_else():
    r = Redactor(key="k")
    with_id = 0
    for req in generate("test", 600, seed=3):
        oid = (req.gold or {}).get("order_id")
        reply = json.dumps(req.gold)
        texts = [req.query, reply] + [t.content for t in req.history] + [m["content"] for m in task_messages(req)]
        masked = [r.redact_text(t) for t in texts]
        if not oid:
            assert all(n == 0 for _, n in masked), req.query  # no false positive on search or support words
            continue
        with_id += 1
        assert all(oid.lower() not in m.lower() for m, _ in masked)
        pseudo = json.loads(masked[1][0])["order_id"]
        assert shape(pseudo) == shape(oid) and pseudo.lower() in masked[0][0].lower()  # the reply still copies it
    assert with_id >= 10


def test_record_is_masked_consistently_across_query_history_messages_and_reply():
    r = Redactor(key="secret")
    q = "Where is order #48213377? mail jane@shop.com or call 555-123-4567"
    record = rec(query=q, history=[Turn(role="user", content="hi, it's about 48213377"),
                                   Turn(role="assistant", content="Which order?")],
                 reply='{"topic": "order_status", "order_id": "48213377"}', redactions=1)
    record = record.model_copy(update={"messages": record.messages + [{"role": "user", "content": "jane@shop.com"}]})
    out = r.redact_record(record)
    pseudo = json.loads(out.reply)["order_id"]
    assert pseudo != "48213377" and len(pseudo) == 8 and pseudo.isdigit()
    assert f"#{pseudo}" in out.query and pseudo in out.history[0].content
    assert out.messages[1]["content"] == out.query            # the message sent is the query, masked the same way
    assert out.messages[0] == record.messages[0]              # the system prompt has nothing to mask
    email = re.search(r"user-[0-9a-f]{6}@example\.com", out.query).group(0)
    assert out.messages[2]["content"] == email
    dump = out.model_dump_json()
    assert "48213377" not in dump and "jane@shop.com" not in dump and "555-123-4567" not in dump
    assert out.redactions == 1 + 3 + 1 + 3 + 1 + 1  # earlier count + query + history + messages + reply
    assert [m["role"] for m in out.messages] == ["system", "user", "user"]
    # the same key gives the same pseudonyms; another key other ones
    assert Redactor(key="secret").redact_record(record).reply == out.reply
    assert Redactor(key="other").redact_record(record).reply != out.reply


def test_user_patterns_on_top_of_the_defaults():
    r = Redactor([r"cust(?P<v>\d{4})", r"(?i)loyalty card \w+"], key="k")
    out, n = r.redact_text("cust1234 with loyalty card XYZ99, order 48213377")
    assert n == 3
    assert out.startswith("cust") and "1234" not in out and "XYZ99" not in out and "48213377" not in out
    # user patterns only
    out, n = Redactor([r"cust\d+"], defaults=False, key="k").redact_text("cust1234 order 48213377")
    assert n == 1 and out.endswith("order 48213377")


def test_bad_user_patterns_are_refused_with_the_pattern_named():
    with pytest.raises(ValueError, match=r"\(unclosed"):
        TrafficConfig(dir=None, redact_patterns=["(unclosed"])
    with pytest.raises(ValueError, match="matches empty text"):
        Redactor([r"\d*"])


def test_writer_redacts_before_writing(tmp_path):
    with TrafficWriter(TrafficConfig(dir=tmp_path, redact_key="k")) as w:
        w.write(rec(query="where is 48213377?", reply='{"order_id": "48213377"}'))
    (f,) = traffic_files(tmp_path)
    assert "48213377" not in f.read_text()
    (back,) = read_traffic(tmp_path)
    assert back.redactions == 3  # the query, the user message and the reply
    assert json.loads(back.reply)["order_id"] in back.query


# --- writer: files, rotation, pruning ---------------------------------------------------------------------------

def test_round_trip(tmp_path):
    records = [rec(i, ts=1000.0 + i, route="speculative", deployment="eagle3-domain-g3", head="domain",
                   head_version="v0002", gamma=3, proposed=30, accepted=21, drafts=10, output_tokens=40,
                   latency_ms=812.5) for i in range(5)]
    with TrafficWriter(TrafficConfig(dir=tmp_path / "t")) as w:
        for r in reversed(records):
            w.write(r)
        assert w.path is not None and NAME.match(w.path.name) and process_id() in w.path.name
    back = read_traffic(tmp_path / "t")
    assert [r.id for r in back] == [f"r{i}" for i in range(5)]  # sorted by ts
    assert back[0].model_dump(exclude={"redactions"}) == records[0].model_dump(exclude={"redactions"})
    assert back[0].tau == pytest.approx(3.1) and rec(drafts=0).tau is None
    req = back[0].request()
    assert (req.id, req.task, req.query) == ("r0", "support", records[0].query)
    # one file read directly, windows by time
    assert len(read_traffic(traffic_files(tmp_path / "t")[0])) == 5
    assert [r.id for r in read_traffic(tmp_path / "t", since=1001, until=1003)] == ["r1", "r2"]
    # a line from a later version with more fields still reads
    f = traffic_files(tmp_path / "t")[0]
    line = json.loads(f.read_text().splitlines()[0])
    with f.open("a") as fh:
        fh.write(json.dumps({**line, "id": "future", "ts": 2000.0, "v": 2, "new_field": 1}) + "\n")
    assert read_traffic(f)[-1].id == "future"


def test_missing_path_says_what_to_give(tmp_path):
    with pytest.raises(FileNotFoundError, match="record-traffic"):
        read_traffic(tmp_path / "nope")
    assert read_traffic(tmp_path) == []


def test_off_config_refuses_a_writer():
    assert not TrafficConfig().enabled
    with pytest.raises(ValueError, match="off"):
        TrafficWriter(TrafficConfig())


def test_rotation_by_size(tmp_path):
    line = len(rec(0).model_dump_json()) + 1
    cfg = TrafficConfig(dir=tmp_path, max_file_bytes=3 * line)
    with TrafficWriter(cfg) as w:
        for i in range(10):
            w.write(rec(i, ts=float(int(time.time()) + i)))  # lines of one length: ids r0..r9, whole seconds
    files = traffic_files(tmp_path)
    assert len(files) == 4 and all(NAME.match(f.name) for f in files)
    assert [len(f.read_text().splitlines()) for f in files] == [3, 3, 3, 1]
    assert all(f.stat().st_size <= cfg.max_file_bytes for f in files)
    assert [r.id for r in read_traffic(tmp_path)] == [f"r{i}" for i in range(10)]


def test_prune_by_total_size_keeps_the_newest(tmp_path):
    line = len(rec(0).model_dump_json()) + 1
    cfg = TrafficConfig(dir=tmp_path, max_file_bytes=2 * line, max_total_bytes=5 * line)
    with TrafficWriter(cfg) as w:
        for i in range(10):
            w.write(rec(i))
            assert sum(f.stat().st_size for f in traffic_files(tmp_path)) <= cfg.max_total_bytes
    assert [r.id for r in read_traffic(tmp_path)] == ["r6", "r7", "r8", "r9"]


def test_prune_by_age_on_open(tmp_path):
    day = 86400.0
    now = time.time()
    old = tmp_path / f"traffic-20200101T000000-{DEAD_PID}.jsonl"
    old.write_text(rec(1, ts=now - 40 * day).model_dump_json() + "\n")
    recent = tmp_path / f"traffic-20200102T000000-{DEAD_PID}.jsonl"
    recent.write_text(rec(2, ts=now - 40 * day).model_dump_json() + "\n"
                      + rec(3, ts=now - day).model_dump_json() + "\n")
    unreadable = tmp_path / f"traffic-20200103T000000-{DEAD_PID}.jsonl"  # no record: its mtime decides
    unreadable.write_text("not json\n")
    os.utime(unreadable, (now - 40 * day, now - 40 * day))
    other = tmp_path / "notes.jsonl"
    other.write_text("{}\n")
    os.utime(other, (now - 40 * day, now - 40 * day))
    w = TrafficWriter(TrafficConfig(dir=tmp_path, max_age_days=30))
    assert sorted(p.name for p in w.pruned.deleted) == [old.name, unreadable.name]
    assert recent.exists() and other.exists()  # only traffic files are pruned
    w.close()


def test_the_file_being_written_is_never_pruned(tmp_path):
    cfg = TrafficConfig(dir=tmp_path, max_age_days=1)
    with TrafficWriter(cfg) as w:
        w.write(rec(0, ts=time.time() - 10 * 86400))
        current = w.path
        w.PRUNE_EVERY_S = 0.0
        w.write(rec(1, ts=time.time() - 10 * 86400))
        assert current.exists()
        other = TrafficWriter(cfg)  # another writer of this process opens the same directory
        assert current.exists() and current not in other.pruned.deleted
        other.close()
    assert TrafficWriter(cfg).pruned.deleted == [current]  # closed and old: pruned by the next writer


def test_threads_write_whole_lines(tmp_path):
    line = len(rec(0).model_dump_json()) + 1
    with TrafficWriter(TrafficConfig(dir=tmp_path, max_file_bytes=50 * line)) as w:
        def work(k: int) -> None:
            for i in range(100):
                w.write(rec(k * 1000 + i))
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    scan = scan_traffic(tmp_path)
    assert len(scan.records) == 400 and scan.skipped == 0 and len(scan.files) >= 8


# --- torn lines ---------------------------------------------------------------------------------------------------

def test_torn_last_line_is_skipped_then_repaired(tmp_path):
    t0 = time.time()
    good = [rec(i, ts=t0 + i).model_dump_json() for i in range(3)]
    torn = rec(3, ts=t0 + 3).model_dump_json()[:57]  # the agent killed mid-write
    f = tmp_path / f"traffic-20260101T000000-{DEAD_PID}.jsonl"
    f.write_text("\n".join(good) + "\n" + torn)
    scan = scan_traffic(tmp_path)
    assert [r.id for r in scan.records] == ["r0", "r1", "r2"] and scan.skipped == 1
    size = f.stat().st_size
    with TrafficWriter(TrafficConfig(dir=tmp_path)) as w:
        assert w.repaired == {f: len(torn)}
        assert f.stat().st_size == size - len(torn) and f.read_text().endswith("\n")
        w.write(rec(4, ts=t0 + 4))
    scan = scan_traffic(tmp_path)
    assert [r.id for r in scan.records] == ["r0", "r1", "r2", "r4"] and scan.skipped == 0


def test_a_killed_writer_loses_at_most_the_line_it_was_writing(tmp_path):
    import signal
    import subprocess
    import sys

    child = (
        "import sys, time\n"
        "from cartspec.task.traffic import TrafficConfig, TrafficRecord, TrafficWriter\n"
        "w = TrafficWriter(TrafficConfig(dir=sys.argv[1]))\n"
        "i = 0\n"
        "while True:\n"
        "    w.write(TrafficRecord(id=f'r{i}', ts=time.time(), task='search', query='boots', messages=[],\n"
        "                          reply='x' * 50_000, temperature=0.0, structured=True))\n"
        "    i += 1\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", child, str(tmp_path)])
    try:
        deadline = time.time() + 60
        while time.time() < deadline and sum(f.stat().st_size for f in traffic_files(tmp_path)) < 2_000_000:
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    (f,) = traffic_files(tmp_path)
    before = scan_traffic(tmp_path)
    assert before.skipped <= 1 and len(before.records) >= 30
    with TrafficWriter(TrafficConfig(dir=tmp_path)) as w:
        assert sum(w.repaired.values()) <= 50_500  # at most the one torn line
    after = scan_traffic(tmp_path)
    assert after.skipped == 0 and f.read_bytes().endswith(b"\n")
    assert [r.id for r in after.records] == [f"r{i}" for i in range(len(before.records))]


def test_repair_torn_tail_edges(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_bytes(b"")
    assert repair_torn_tail(f) == 0
    f.write_bytes(b'{"a": 1}\n')
    assert repair_torn_tail(f) == 0 and f.read_bytes() == b'{"a": 1}\n'
    f.write_bytes(b'{"a": 1')  # a single torn line: nothing left
    assert repair_torn_tail(f) == 7 and f.read_bytes() == b""
    big = b"x" * 200_000  # a torn line longer than one read-back chunk
    f.write_bytes(b'{"a": 1}\n' + big)
    assert repair_torn_tail(f) == len(big) and f.read_bytes() == b'{"a": 1}\n'


def test_an_older_versions_file_named_by_a_running_pid_is_not_repaired(tmp_path):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        f = tmp_path / f"traffic-20260101T000000-{proc.pid}.jsonl"
        f.write_text(rec(0).model_dump_json() + "\n" + '{"v": 1, "id"')
        with TrafficWriter(TrafficConfig(dir=tmp_path)) as w:
            assert w.repaired == {}
        assert f.read_text().endswith('"id"')
    finally:
        proc.kill()
        proc.wait()


# --- owner-only files, symlinks, writers sharing a volume -----------------------------------------------------

def _mode(p) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_directory_and_files_are_owner_only_whatever_the_umask(tmp_path):
    old = os.umask(0)  # a umask that would leave everything open
    try:
        line = len(rec(0).model_dump_json()) + 1
        with TrafficWriter(TrafficConfig(dir=tmp_path / "new" / "traffic", max_file_bytes=2 * line)) as w:
            for i in range(3):
                w.write(rec(i))
        shared = tmp_path / "shared"
        shared.mkdir(mode=0o755)
        legacy = shared / f"traffic-20260101T000000-{DEAD_PID}.jsonl"  # an older version's leftover, 0644
        legacy.write_text(rec(9).model_dump_json() + "\n")
        legacy.chmod(0o644)
        TrafficWriter(TrafficConfig(dir=shared)).close()
    finally:
        os.umask(old)
    files = traffic_files(tmp_path / "new" / "traffic")
    assert len(files) == 2 and all(_mode(f) == 0o600 for f in files)
    assert _mode(tmp_path / "new" / "traffic") == 0o700 and _mode(tmp_path / "new") == 0o700  # parents made too
    assert _mode(shared) == 0o700 and _mode(legacy) == 0o600  # an existing directory and its files tightened


def test_a_directory_others_can_write_is_refused_with_what_to_do(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(UnsafePathError, match=r"cannot record traffic into .*open.*chmod go-w"):
        TrafficWriter(TrafficConfig(dir=d))
    assert _mode(d) == 0o777 and list(d.iterdir()) == []  # refused, not "fixed" behind the user's back


def test_a_symlink_named_like_a_traffic_file_is_never_followed(tmp_path):
    d, outside = tmp_path / "traffic", tmp_path / "elsewhere"
    d.mkdir()
    outside.mkdir()
    day = 86400.0
    target = outside / "precious.jsonl"
    content = rec(0, ts=time.time() - 40 * day).model_dump_json() + "\n" + '{"torn'  # old, with a torn tail
    target.write_text(content)
    link = d / f"traffic-20200101T000000-{DEAD_PID}.jsonl"
    link.symlink_to(target)
    w = TrafficWriter(TrafficConfig(dir=d, max_age_days=1))  # would repair and prune a leftover like it
    assert w.repaired == {} and w.pruned.deleted == []
    assert link.is_symlink() and target.read_text() == content  # neither the link nor its target touched
    assert traffic_files(d) == [] and read_traffic(d) == []       # not a traffic file
    with pytest.raises(UnsafePathError, match="symlink"):
        repair_torn_tail(link)
    assert target.read_text() == content
    w.close()


def test_a_symlink_in_the_place_of_the_next_file_is_not_written_through(tmp_path, monkeypatch):
    from cartspec.task import traffic

    monkeypatch.setattr(traffic, "_PROCESS_ID", "0123456789abcdef")  # the name the writer will choose
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    d = tmp_path / "traffic"
    d.mkdir(mode=0o700)
    now = time.time()
    for s in range(-1, 5):  # the names of files started in the seconds around this one
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now + s))
        (d / f"traffic-{stamp}-0123456789abcdef.jsonl").symlink_to(target)
    with TrafficWriter(TrafficConfig(dir=d)) as w:
        w.write(rec(0))
        assert not w.path.is_symlink() and w.path.name.endswith("-1.jsonl")  # the next name, as a plain file
    assert target.read_text() == "keep me"
    assert [r.id for r in read_traffic(d)] == ["r0"]


WRITER = r'''
import os, sys, time
os.getpid = lambda: 1  # every replica is PID 1 in its own container
from cartspec.task.traffic import TrafficConfig, TrafficRecord, TrafficWriter
w = TrafficWriter(TrafficConfig.model_validate_json(sys.argv[1]))

def record(i):
    return TrafficRecord(id=f"a{i}", ts=time.time(), task="search", query="boots", messages=[],
                         reply="x" * 200, temperature=0.0, structured=True)

def half_a_line(i):  # as a long line is written: its first part is in the file, the rest still to come
    line = (w.redactor.redact_record(record(i)).model_dump_json() + "\n").encode()
    w._fh.write(line[:40])
    w._fh.flush()
    return line[40:]

w.write(record(0))
w.write(record(1))
rest = half_a_line(2)
print(w.path, flush=True)
sys.stdin.readline()
w._fh.write(rest)
w.write(record(3))
half_a_line(4)  # then killed mid-line
print("torn", flush=True)
time.sleep(600)
'''


def test_two_writers_sharing_a_pid_never_touch_each_others_files(tmp_path, monkeypatch):
    import signal
    import subprocess
    import sys

    line = len(rec(0, reply="x" * 200).model_dump_json()) + 1
    # tight limits: a writer that took the other's live file for a leftover would repair and delete it
    tight = TrafficConfig(dir=tmp_path, max_file_bytes=4 * line, max_total_bytes=4 * line, max_age_days=1)
    a = subprocess.Popen([sys.executable, "-c", WRITER, tight.model_dump_json()], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        a_path = Path(a.stdout.readline().strip())
        size = a_path.stat().st_size
        monkeypatch.setattr(os, "getpid", lambda: 1)  # the second replica: PID 1 as well
        b = TrafficWriter(tight)
        assert b.repaired == {} and b.pruned.deleted == []
        assert a_path.stat().st_size == size  # the half-written line of the live writer is still there
        b.write(rec(0, reply="x" * 200).model_copy(update={"id": "b0"}))
        b.write(rec(1, reply="x" * 200).model_copy(update={"id": "b1"}))
        assert b.path != a_path and a_path.exists()
        a.stdin.write("go on\n")
        a.stdin.flush()
        assert a.stdout.readline().strip() == "torn"
        a.send_signal(signal.SIGKILL)
        a.wait()
        b.close()
        # the first replica was killed mid-line: the next writer repairs its file, now a leftover
        with TrafficWriter(TrafficConfig(dir=tmp_path)) as c:
            assert list(c.repaired) == [a_path] and c.pruned.deleted == []
    finally:
        a.kill()
        a.wait()
    scan = scan_traffic(tmp_path)
    assert scan.skipped == 0
    assert sorted(r.id for r in scan.records) == ["a0", "a1", "a2", "a3", "b0", "b1"]  # no record lost


# --- dedupe and time split ----------------------------------------------------------------------------------------

def test_dedupe_keeps_the_latest_of_each_request():
    rs = [
        rec(0, ts=10, query="Where is my  order?"),
        rec(1, ts=30, query="where is my order?"),                   # same after whitespace/case: the latest wins
        rec(2, ts=20, query="WHERE is my order? "),
        rec(3, ts=15, query="where is my order?", task="search"),    # another task
        rec(4, ts=25, query="where is my order?", history=[Turn(role="user", content="hi")]),  # another history
        rec(5, ts=26, query="where is my order?", history=[Turn(role="user", content=" HI ")]),
    ]
    out = dedupe(rs)
    assert [r.id for r in out] == ["r3", "r5", "r1"]


def test_split_by_time_holds_out_the_most_recent_share():
    rs = [rec(i, ts=float(t)) for i, t in enumerate([5, 1, 9, 3, 7, 2, 8, 4, 6, 10])]
    train, held = split_by_time(rs, 0.2)
    assert [r.ts for r in train] == [1, 2, 3, 4, 5, 6, 7, 8] and [r.ts for r in held] == [9, 10]
    assert max(r.ts for r in train) <= min(r.ts for r in held)
    train, held = split_by_time(rs[:3], 0.1)  # a share that rounds to nothing still holds out one
    assert len(train) == 2 and len(held) == 1
    assert split_by_time(rs, 0.0) == (sorted(rs, key=lambda r: r.ts), [])
    assert split_by_time([], 0.2) == ([], [])
    with pytest.raises(ValueError, match="held_out"):
        split_by_time(rs, 1.0)


def test_the_documented_example_line_is_what_the_writer_writes():
    from pathlib import Path

    from cartspec.task.data import Request

    doc = (Path(__file__).resolve().parents[1] / "docs" / "traffic.md").read_text()
    line = re.search(r"```json\n(\{.*\})\n```", doc).group(1)
    documented = TrafficRecord.model_validate_json(line)
    q = "where is my order #48213377? reach me at jane.doe@gmail.com"
    raw = documented.model_copy(update={
        "query": q, "messages": task_messages(Request(task="support", query=q)),
        "reply": '{"topic":"order_status","order_id":"48213377"}', "redactions": 0})
    assert Redactor(key="docs").redact_record(raw).model_dump_json() == line
