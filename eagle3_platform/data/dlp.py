"""DLP recognizers: secrets that must never reach training data (cloud keys, API tokens, private keys,
passwords in URLs), plus the street-address recognizer presidio lacks.

Each is a presidio `PatternRecognizer`, case-SENSITIVE (presidio's default flags include IGNORECASE,
which would turn `AKIA[A-Z0-9]{16}` into "any 20 letters"). Obvious placeholders from docs and
tutorials (`AKIAIOSFODNN7EXAMPLE`, `postgres://user:password@localhost`, `Bearer YOUR_TOKEN`) are
invalidated: they are not secrets, and code prompts are full of them.

DLP findings are always grounds to DROP a record (filter.py), never just to redact it: a key that
leaked once may appear elsewhere in the same conversation in a form no pattern catches (split across
lines, base64'd), so the whole record goes.
"""
from __future__ import annotations

import re

from presidio_analyzer import Pattern, PatternRecognizer

# entity -> (pattern name, regex, score). Scores >= 0.8: these shapes are specific enough on their own.
_PEM = r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----"
DLP_PATTERNS: dict[str, list[tuple[str, str, float]]] = {
    "AWS_ACCESS_KEY": [("aws key id", r"\b(?:AKIA|ASIA|ABIA|ACCA|AIDA|AROA)[A-Z0-9]{16}\b", 0.9)],
    "AWS_SECRET_KEY": [(
        "aws secret assignment",
        r"(?i:aws_?secret_?(?:access_?)?key)[\"']?\s*[:=]\s*[\"']?[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+])",
        0.9)],
    "GCP_API_KEY": [("google api key", r"\bAIza[0-9A-Za-z_\-]{35}(?![0-9A-Za-z_\-])", 0.9)],
    "GCP_SERVICE_ACCOUNT_KEY": [("service account json", r"\"private_key_id\"\s*:\s*\"[0-9a-f]{40}\"", 0.9)],
    "GITHUB_TOKEN": [
        ("github classic", r"\bgh[pousr]_[A-Za-z0-9]{36,255}\b", 0.95),
        ("github fine-grained", r"\bgithub_pat_[A-Za-z0-9_]{50,255}\b", 0.95),
    ],
    "SLACK_TOKEN": [
        ("slack token", r"\bxox[abposr]-[A-Za-z0-9-]{10,}", 0.9),
        ("slack webhook", r"https://hooks\.slack\.com/services/T[A-Z0-9]+/B[A-Z0-9]+/[A-Za-z0-9]+", 0.9),
    ],
    "OPENAI_API_KEY": [("sk- key", r"\bsk-(?:proj-|svcacct-|admin-|ant-[a-z0-9]+-)?[A-Za-z0-9_\-]{32,}", 0.85)],
    "JWT": [("jwt", r"\beyJ[A-Za-z0-9_-]{10,}\.eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}", 0.9)],
    "BEARER_TOKEN": [("bearer header", r"\b[Bb]earer\s+[A-Za-z0-9\-._~+/]{20,}=*", 0.8)],
    "PRIVATE_KEY": [(
        "pem private key",
        # the whole block when it is closed, else the header plus whatever base64 follows (truncated paste)
        _PEM + r"(?:[\s\S]*?-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----|[A-Za-z0-9+/=\s]*)",
        1.0)],
    "URL_CREDENTIALS": [(
        "password in url",
        r"\b[a-zA-Z][a-zA-Z0-9+.\-]{1,15}://[^\s:/@\"'<>]+:[^\s@/\"'<>]+@[^\s/\"'<>]+",
        0.9)],
    "GENERIC_SECRET": [(
        "quoted secret assignment",
        r"(?i:\b(?:password|passwd|secret|api_?key|access_?token|auth_?token|client_?secret))[\"']?\s*[:=]\s*"
        r"[\"'][^\"'\s]{8,}[\"']",
        0.8)],
}
DLP_ENTITIES = frozenset(DLP_PATTERNS)

# Tokens that mark a value as a documentation placeholder rather than a live secret.
_PLACEHOLDER = re.compile(
    r"(?-i:EXAMPLE)|your[_\-]?|<[^>]*>|\$\{|\{\{|x{6,}|X{6,}|\*{3,}|\.\.\.|changeme|redacted|dummy|"
    r"://[^:/@]+:(?:pass(?:word)?|pwd|secret|pw|\*+|x+)@",
    re.IGNORECASE,
)
_TOKEN_WORDS = re.compile(r"^(?:[Bb]earer\s+)?[A-Z]+(?:_[A-Z]+)+$")  # "Bearer ACCESS_TOKEN_HERE", not a key id


class SecretRecognizer(PatternRecognizer):
    """Case-sensitive pattern recognizer that drops documentation placeholders."""

    def invalidate_result(self, pattern_text: str) -> bool:
        return bool(_PLACEHOLDER.search(pattern_text) or _TOKEN_WORDS.match(pattern_text))


# Street addresses: presidio ships none. US style "1600 Pennsylvania Avenue NW [Suite 4]" (number, 1-4
# capitalised words, a USPS street suffix), UK style "221B Baker Street", PO boxes, and the
# "City, ST 12345" line (also APO/FPO military lines). A bare city is LOCATION (NER), not an address.
# USPS Publication 28 street suffixes (C1, full names + common abbreviations), plural "s" allowed,
# minus those that are everyday title words ("20 Most Common Words", "Top 5 Points"): _TITLE_WORDS.
_TITLE_WORDS = frozenset("Common Course Key Light Point Land Rest Run Union Pass Path Track View Wall Well "
                         "Fall Club Lock Loaf Station Center Centre Corner".split())
_SUFFIX = "|".join(w for w in (
    "Alley Avenue Ave Branch Bridge Brook Burg Bypass Camp Canyon Cape Causeway Center Centre Circle Cir "
    "Cliff Close Club Common Corner Course Court Ct Cove Creek Crescent Cres Crest Crossing Crossroad Curve "
    "Dale Dam Divide Drive Dr Estate Expressway Extension Fall Ferry Field Flat Ford Forest Forge Fork Fort "
    "Freeway Garden Gateway Glen Green Grove Harbor Haven Heights Highway Hwy Hill Hollow Inlet Island Isle "
    "Junction Key Knoll Lake Land Landing Lane Ln Light Loaf Lock Lodge Loop Mall Manor Meadow Mews Mill "
    "Mission Motorway Mount Mountain Neck Orchard Oval Overpass Park Parkway Pkwy Pass Passage Path Pike "
    "Pine Place Pl Plain Plaza Point Port Prairie Radial Ramp Ranch Rapid Rest Ridge River Road Rd Route "
    "Row Rue Run Shoal Shore Skyway Spring Spur Square Sq Station Stravenue Stream Street St Summit Terrace "
    "Ter Throughway Trace Track Trafficway Trail Trl Tunnel Turnpike Underpass Union Valley Via Viaduct "
    "View Village Ville Vista Walk Wall Way Well Blvd Boulevard"
).split() if w not in _TITLE_WORDS)
ADDRESS_PATTERNS: list[tuple[str, str, float]] = [
    # [ \t] not \s: an address sits on one line; "Step 3\nOpen Settings" must not read as one
    ("street", r"\b\d{1,6}[A-Z]?(?:[ \t]+(?:[NSEW]|North|South|East|West))?(?:[ \t]+[A-Z][a-zA-Z'\-]+){1,4}"
               r"[ \t]+(?:" + _SUFFIX + r")s?\b\.?(?:[ \t]+(?:[NS][EW]|[NSEW])\b)?"
               r"(?:,?[ \t]+(?:Apt\.?|Suite|Unit|Ste\.?|#)[ \t]*[\w\-]+)?", 0.7),
    ("po box", r"\b(?:P\.?\s?O\.?\s+Box|PSC\s+\d{3,5},?\s+Box)\s+\d{1,6}\b", 0.7),
    ("city state zip", r"\b[A-Z][a-zA-Z]+(?:\s+[A-Z][a-zA-Z]+){0,2},\s+(?:A[AEKLPRSZ]|C[AOT]|D[CE]|F[LM]|"
                       r"G[AU]|HI|I[ADLN]|K[SY]|LA|M[ADEHINOPST]|N[CDEHJMVY]|O[HKR]|P[ARW]|RI|S[CD]|T[NX]|"
                       r"UT|V[AIT]|W[AIVY])\s+\d{5}(?:-\d{4})?\b", 0.7),
    ("military", r"\b(?:APO|FPO|DPO)\s+A[AEP]\s+\d{5}\b", 0.7),
    ("uk postcode", r"\b[A-Z]{1,2}\d[A-Z\d]?\s\d[A-Z]{2}\b", 0.6),
]


def dlp_recognizers() -> list[PatternRecognizer]:
    return [
        SecretRecognizer(supported_entity=ent, name=f"dlp_{ent.lower()}",
                         patterns=[Pattern(n, rx, s) for n, rx, s in pats], global_regex_flags=re.MULTILINE)
        for ent, pats in DLP_PATTERNS.items()
    ]


def address_recognizer() -> PatternRecognizer:
    return PatternRecognizer(supported_entity="STREET_ADDRESS", name="street_address",
                             patterns=[Pattern(n, rx, s) for n, rx, s in ADDRESS_PATTERNS],
                             global_regex_flags=re.MULTILINE)
