"""A multi-country name gazetteer (from the names-dataset package, see data/README.md) and the
name rules that use it: what a small NER model misses.

The gazetteer never makes a name out of nothing: a word must be a known name AND stand where
names stand — the model already called it an entity (ORG, NORP, a product...), it is written in
lower case where the model said PERSON, it is a first name followed by a surname, or it is in
a list of names ("Kónya, Becker and Vasquez") or a speaker line ("Halldór: What a wife.").

    python -m governance.sanitizer.names build   # rebuild data/*.txt.gz from names-dataset
"""

from __future__ import annotations

import gzip
import re
import sys
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

from governance import recognizers as R

DATA = Path(__file__).parent / "data"
TOP_RANK = 1000
# The broad lists add names ranked 1,001-5,000 in some country ("Wisława", "Irenke",
# "Einojuhani"), less the common English words among them (wordfreq Zipf >= 3: "Block",
# "Glad", "Radio"). They count for capitalised words only: in lower-case text a name needs
# the top-1,000 lists ("block it", "glad to hear").
BROAD_RANK = 5000
BROAD_MAX_ZIPF = 3.0

# English words that are also names somewhere: never a name on the gazetteer's word alone.
_ENGLISH = frozenset("""
a an the and or but if of in on at to for from by with as is are was were be been am do does did
have has had i you he she it we they me him her us them my your his its our their this that these
those who whom what which when where why how all any both each few more most other some such no
nor not only own same so than too very can will just should now may might must shall would could
one two three four five six seven eight nine ten new old good great best first last long little
big high low next early late young right left back here there then today tomorrow yesterday
mark bill grace hope joy rose summer autumn winter spring dawn faith chance page lane rich king
price long hill wood ford cook young brown white black green gray grey golden silver star sky
love happy sunny honey angel baby lady sir boy girl man woman men women son daughter father
mother brother sister family friend people person team group company office home house city
town street road park river lake sea ocean mountain north south east west
monday tuesday wednesday thursday friday saturday sunday january february march april june july
august september october november december christmas easter
hi hello hey dear thanks thank please yes no ok okay sure well also still even ever never always
see say said tell told ask asked call called want need get got make made take took give gave
go went come came know knew think thought look looked find found work worked help way day
time year week month hour minute night morning evening world life hand part place case point
number name account card order data file line note page item list table view report
""".split())


def _load(name: str) -> frozenset[str]:
    return frozenset(_load_words(name))


@lru_cache(maxsize=1)
def gazetteer() -> tuple[frozenset[str], frozenset[str]]:
    """(first names, last names), case-folded: the top 1,000 of each country."""
    return _load("first_names"), _load("last_names")


class _HashSet:
    """Membership in a large word list at 8 bytes a word: the sorted hashes of the words in a
    numpy array, looked up by bisection (a frozenset of the 411k broad names costs ~60 MB a
    process). Python's string hash is per process, so the array is built at load; a collision
    makes a non-name a name with odds ~1e-14 a lookup."""

    def __init__(self, words: Iterable[str]):
        import numpy as np

        self._keys = np.unique(np.fromiter((hash(w) for w in words), dtype=np.int64))

    def __contains__(self, word: str) -> bool:
        k = hash(word)
        i = int(self._keys.searchsorted(k))
        return i < len(self._keys) and int(self._keys[i]) == k

    def __len__(self) -> int:
        return len(self._keys)


def _load_words(name: str) -> list[str]:
    with gzip.open(DATA / f"{name}.txt.gz", "rt", encoding="utf-8") as f:
        return [w.casefold() for w in f.read().split()]


@lru_cache(maxsize=1)
def broad_gazetteer() -> tuple[_HashSet, _HashSet]:
    """(first names, last names) ranked 1,001-5,000 in some country, not in `gazetteer()`."""
    return _HashSet(_load_words("first_names_more")), _HashSet(_load_words("last_names_more"))


@lru_cache(maxsize=1)
def english_names() -> frozenset[str]:
    """Top-1,000 names that are also common English words (wordfreq Zipf >= 3: "main", "sha",
    "block", "chad"): in lower-case text after a weak cue ("with", "to") they are words."""
    return _load("english_names")


def _fold(word: str) -> str:
    return word.casefold().strip(".,:;'\"’")


def is_first(word: str) -> bool:
    w = _fold(word)
    return w not in _ENGLISH and (w in gazetteer()[0] or (
        word[:1].isupper() and w in broad_gazetteer()[0]))


def in_any_list(word: str) -> bool:
    """A known name in any list, whatever its case (for words that stand where names stand)."""
    w = _fold(word)
    if w in _ENGLISH:
        return False
    first, last = gazetteer()
    more_first, more_last = broad_gazetteer()
    return w in first or w in last or w in more_first or w in more_last


def is_name(word: str) -> bool:
    w = _fold(word)
    if w in _ENGLISH:
        return False
    first, last = gazetteer()
    if w in first or w in last:
        return True
    if not word[:1].isupper():
        return False
    more_first, more_last = broad_gazetteer()
    return w in more_first or w in more_last


_INITIAL = re.compile(rf"[A-Za-z{R.UP}{R.LO}]\.?")
_PARTICLES = frozenset("van von der den de del della da das do dos di du die ten ter le la y e "
                       "bin ibn al el".split())


def all_names(value: str, need_first: bool = True) -> bool:
    """Every word a known name (initials and particles aside), the first a first name."""
    words = [w for w in re.split(r"[\s\-]+", value.strip()) if w]
    core = [w for w in words if not _INITIAL.fullmatch(w) and w.casefold() not in _PARTICLES]
    if not core or len(core) > 4:
        return False
    if any(w.casefold().strip(".,'’") in R.AGENT_VOCAB or w.casefold().strip(".,'’") in
           R.ORG_WORDS for w in core):
        return False
    if need_first and not is_first(core[0]):
        return False
    return all(is_name(w) for w in core)


_W = rf"[{R.UP}][{R.LO}'’]+(?:-[{R.UP}][{R.LO}'’]+)?"
_FIRST_LAST = re.compile(
    rf"(?<![\w@.])({_W}(?:[ \t]+[{R.UP}]\.?)?"
    rf"(?:[ \t]+(?:van|von|de|da|di|del|der|ten|le|la)){{0,2}}[ \t]+{_W})(?![\w@])")
_LIST = re.compile(rf"(?<![\w@.])({_W}(?:[ \t]+{_W})?)(?=[ \t]*(?:,|[ \t]and[ \t]|[ \t]&[ \t]))"
                   rf"|(?<=[ \t]and[ \t])({_W}(?:[ \t]+{_W})?)(?![\w@])")
_SPEAKER = re.compile(rf"(?m)^[ \t]*({_W})[ \t]*:(?=[ \t]*\S)")
# A lower-case speaker line of a dialogue: a word, a colon, then speech (a quote, or two words
# or more: "mika: \"who are you?\"", "tracy:i'm fine, thanks"), not a config value.
_LOWER_SPEAKER = re.compile(r"(?m)^[ \t]*([a-zà-ÿ][a-zà-ÿ'’\-]+)[ \t]*:[ \t]*"
                            r"(?=[\"“'‘]|[^\s\"“'‘:][^\n]*?[ \t]\S)")
_LOWER_CUE = re.compile(
    r"\b(?i:my name is|name is|name:|i'm|i am|this is|dear|hi|hello|mr\.?|mrs\.?|ms\.?|"
    r"dr\.?|with|from|to|by|for|of|called|named|contact|customer|client|patient)[ \t]+"
    r"([a-zà-ÿ][a-zà-ÿ'’\-]+(?:[ \t]+(?:[a-z]\.?[ \t]+)?[a-zà-ÿ][a-zà-ÿ'’\-]+){0,2})")
_WEAK_LOWER_CUES = frozenset({"with", "from", "to", "by", "for", "of"})
_LOWER_LINE = re.compile(r"(?m)^[ \t]*([a-zà-ÿ][a-zà-ÿ'’\-]+(?:[ \t]+[a-z]\.?)?[ \t]+"
                         r"[a-zà-ÿ][a-zà-ÿ'’\-]+)[ \t]*$")


# Words that end a street or place, never a surname ("Maria Street", "Victoria Station").
_PLACE_WORDS = frozenset("""
street st str road rd avenue ave boulevard blvd lane ln drive dr way court ct place pl square
terrace close parkway highway circle trail route row walk alley mews gardens grove hill park
green quay plaza point ridge view vista crossing station airport bridge beach island bay
via rue calle""".split())


def surname_like(word: str) -> bool:
    """A capitalised word that may be an unfamiliar surname: not English, not agent or
    organisation vocabulary, not a street or place word."""
    w = word.casefold().strip(".,:;'\"’")
    return (len(w) >= 2 and word[:1].isupper() and w not in _ENGLISH and w not in _PLACE_WORDS
            and w not in R.AGENT_VOCAB and w not in R.ORG_WORDS)


def first_and_surname(value: str) -> bool:
    """A known first name followed by capitalised words that could be surnames
    ("Edvard Petrussen", "Esat Jeknić"): the surname need not be in the gazetteer."""
    words = [w for w in re.split(r"[\s\-]+", value.strip()) if w]
    core = [w for w in words if not _INITIAL.fullmatch(w) and w.casefold() not in _PARTICLES]
    if len(core) < 2 or len(core) > 4 or not is_first(core[0]):
        return False
    return all(surname_like(w) for w in core[1:])


# A name on a line of its own (a signature, the first line of an address block), after an
# optional quote mark: "> Ella H. Snider", "??? Carly Jones".
_NAME_LINE = re.compile(rf"(?m)^[ \t]*(?:[>?*\-][ \t>?*\-]*)?({_W}(?:[ \t]+[{R.UP}]\.?)?"
                        rf"(?:[ \t]+{_W}){{1,2}})[ \t]*$")
# Cues after which one word is a person's name whatever the gazetteer says.
_STRONG_CUE = re.compile(
    rf"(?i:\b(?:named|call(?:s|ed)?[ \t]+me|(?:last|first|family|given|middle|sur|nick)[ \t]?name"
    rf"(?:[ \t]+is)?\??|"
    rf"(?:my|our|his|her|their|your)[ \t]+(?:kid|son|daughter|wife|husband|partner|brother|"
    rf"sister|mom|mum|dad|mother|father|friend|boss|colleague|cousin|uncle|aunt|nephew|niece|"
    rf"grandson|granddaughter|grandmother|grandfather|boyfriend|girlfriend|fianc[ée]e?|child|"
    rf"baby|neighbou?r|roommate|flatmate|manager|doctor|lawyer|tenant|landlord))"
    rf"[ \t]*[:,]?[ \t]+(?:(?:him|her|them)[ \t]+)?)"
    rf"([{R.UP}{R.LO}][{R.LO}'’]+(?:-[{R.UP}{R.LO}][{R.LO}'’]+)?)(?![\w@])")
# Weaker cues: a known first name after a verb of speech or company, or before a comma or a
# verb at the start of a sentence ("said Gladys to Logan", "Vide, can I ...", "Shovda is").
_WEAK_BEFORE = re.compile(
    rf"(?i:\b(?:said|says|told|tell|asked|ask|thank|thanks|meet|met|with|and|by|to|for|from|"
    rf"add|under|let|see|saw|call|email|ping|invite|hire|hired|cc)[ \t]+)({_W})(?![\w@])"
    # ... but not a city or a host before a word that makes it one ("to Paris region",
    # "ask Berlin team", "with Jordan cluster").
    rf"(?![ \t]+(?:region|team|office|cluster|server|servers|datacenter|data[ \t]?cent(?:er|re)|"
    rf"zone|area|city|branch|site|campus|airport|station|hq|time|timezone|build|release|repo|"
    rf"project|account|instance|node|pool|bucket|deployment|environment|env|endpoint|"
    rf"mirror|queue|edition|version)\b)")
_PLACE_PREPOSITIONS = frozenset({"to", "for", "from", "with", "by", "and", "under"})
# After these a city is a destination or an origin ("ship to Dallas"); after "with" or "and"
# it is as often a person ("with Florence").
_TO_PLACE = frozenset({"to", "for", "from"})
_WEAK_AFTER = re.compile(
    rf"(?:^|(?<=[.!?][ \t])|(?<=\n))[ \t]*({_W})(?=[ \t]*,|[ \t]+(?:is|was|has|had|lives|"
    rf"lived|said|says|will|would|can|could|wants|wanted|called|went|works|worked|and)\b)")


class GazetteerNameRecognizer:
    """Names the NER model did not call PERSON, found with the gazetteer (see module doc)."""

    name = "name_gazetteer"
    entity_type = "PERSON"

    def find(self, text: str) -> Iterable[R.Span]:
        pos = 0
        while (m := _FIRST_LAST.search(text, pos)) is not None:
            value = m.group(1)
            if all_names(value):
                yield R.Span("PERSON", m.start(1), m.end(1), 0.65, self.name)
            elif first_and_surname(value):
                yield R.Span("PERSON", m.start(1), m.end(1), 0.6, "name_first+surname")
            else:
                # "Producer Vilhjálmur Georgsson": a capitalised word before the name is not
                # part of it; try again from the next word.
                pos = m.start(1) + len(value.split()[0])
                continue
            pos = m.end(1)
        for m in _NAME_LINE.finditer(text):
            value = m.group(1)
            words = value.split()
            if all(surname_like(w) or _INITIAL.fullmatch(w) for w in words) and any(
                    is_name(w) for w in words):
                yield R.Span("PERSON", m.start(1), m.end(1), 0.6, "name_line")
        for m in _STRONG_CUE.finditer(text):
            word = m.group(1)
            # "my manager Reviewed the PR": a past tense or a gerund is no name, unless known.
            if word.casefold().endswith(("ed", "ing")) and not is_name(word):
                continue
            # "No module named pandas", "a column named total": after "named"/"called" a
            # lower-case word is a name only when the gazetteer knows it ("a guy named bob").
            if word[:1].islower() and not in_any_list(word):
                continue
            if word.casefold() not in _ENGLISH and word.casefold() not in R.AGENT_VOCAB:
                yield R.Span("PERSON", m.start(1), m.end(1), 0.7, "name_cue")
        for rx in (_WEAK_BEFORE, _WEAK_AFTER):
            for m in rx.finditer(text):
                cue = text[m.start():m.start(1)].strip().casefold()
                # "ship to Jordan" is a country, "tell Jordan" a person.
                word = m.group(1).casefold()
                if cue in _PLACE_PREPOSITIONS and (word in R.country_names() or (
                        cue in _TO_PLACE and word in R.city_names())):
                    continue
                if is_first(m.group(1)) and surname_like(m.group(1)):
                    yield R.Span("PERSON", m.start(1), m.end(1), 0.6, "name_cue")
        members = [(m.start(m.lastindex), m.end(m.lastindex), m.group(m.lastindex))
                   for m in _LIST.finditer(text)]
        # "ship to Jordan and Chad": countries are no list of people; nor is a list made of
        # cities only ("deploy to Paris and Berlin"; "Morrison, Rogers and Torres" are people).
        members = [x for x in members if x[2].casefold() not in R.country_names()]
        if all(x[2].casefold() in R.city_names() for x in members):
            members = []
        named = [x for x in members if all_names(x[2], need_first=False)]
        if len(named) >= 2:
            # Two known names make it a list of people: its other one-word members are too
            # ("Monjeau, Graves and Reed").
            named += [x for x in members if x not in named and " " not in x[2]
                      and surname_like(x[2])]
            for start, end, _ in named:
                yield R.Span("PERSON", start, end, 0.6, "name_list")
        for m in _SPEAKER.finditer(text):
            if is_first(m.group(1)) or all_names(m.group(1), need_first=False):
                yield R.Span("PERSON", m.start(1), m.end(1), 0.6, "name_speaker")
        if text.count(":") >= 2:
            # Two speakers or more with first names make it a dialogue ("max: true" and
            # "ruby: 3.2" in a config are no speech).
            speakers = [m for m in _LOWER_SPEAKER.finditer(text)
                        if is_first(m.group(1)) and _fold(m.group(1)) not in R.AGENT_VOCAB]
            if len({_fold(m.group(1)) for m in speakers}) >= 2:
                for m in speakers:
                    yield R.Span("PERSON", m.start(1), m.end(1), 0.6, "name_speaker")
        if any(c.islower() for c in text):
            for rx in (_LOWER_CUE, _LOWER_LINE):
                for m in rx.finditer(text):
                    value = m.group(1)
                    words = value.split()
                    cue = text[m.start():m.start(1)].strip().casefold()
                    # Take the longest run of leading words that are all names.
                    while words and not all_names(" ".join(words), need_first=False):
                        words.pop()
                    # "with sha 3f2a9c1", "to main": after a weak cue one word that is also
                    # common English is that word ("with patricia desrosiers" is two names).
                    if (rx is _LOWER_CUE and cue in _WEAK_LOWER_CUES and len(words) == 1
                            and _fold(words[0]) in english_names()):
                        continue
                    if words and (len(words) >= 2 or is_first(words[0])):
                        end = m.start(1) + len(" ".join(words)) if " ".join(words) == \
                            value[:len(" ".join(words))] else m.end(1)
                        yield R.Span("PERSON", m.start(1), end, 0.6, "name_lowercase")


GAZETTEER_NAMES = GazetteerNameRecognizer()


def reclassify_as_person(label: str, value: str) -> bool:
    """A model entity that is made of known names only: a person the model mislabelled
    (spaCy's English models call many unfamiliar names ORG, NORP or PRODUCT)."""
    if label in ("ORG", "PRODUCT", "WORK_OF_ART", "EVENT", "FAC", "LAW", "CARDINAL"):
        return all_names(value, need_first=False)
    if label in ("GPE", "LOC", "NORP"):  # "Berlin", "Swedish" are surnames too: two words
        return len(value.split()) >= 2 and all_names(value)
    if label == "PERSON":  # lower-case names the shape rules refuse
        return all_names(value, need_first=False)
    return False


def build() -> None:  # pragma: no cover - a maintainer's tool
    """Write data/*_names.txt.gz (rank <= TOP_RANK) and data/*_names_more.txt.gz (TOP_RANK <
    rank <= BROAD_RANK, less common English words) from names-dataset; needs the `gazetteer`
    dependency group (names-dataset, wordfreq)."""
    import pickle

    import names_dataset  # noqa: F401 - only to find its data files
    from wordfreq import zipf_frequency

    root = Path(names_dataset.__file__).parent / "v3"
    common: set[str] = set()
    for kind in ("first", "last"):
        with gzip.open(root / f"{kind}_names.pkl.gz") as f:
            data = pickle.load(f)  # noqa: S301 - the package's own data file
        best = {k: min(v["rank"].values()) for k, v in data.items()
                if v.get("rank") and len(k) >= 2 and k.isalpha()}
        del data
        core = sorted(k for k, r in best.items() if r <= TOP_RANK)
        more = sorted(k for k, r in best.items() if TOP_RANK < r <= BROAD_RANK
                      and zipf_frequency(k.casefold(), "en") < BROAD_MAX_ZIPF)
        for name, keep in ((f"{kind}_names", core), (f"{kind}_names_more", more)):
            _write(name, keep)
        common |= {k.casefold() for k in core if zipf_frequency(k.casefold(), "en") >= 3.0}
    _write("english_names", sorted(common))


def _write(name: str, words: list[str]) -> None:  # pragma: no cover - build() only
    with gzip.open(DATA / f"{name}.txt.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(words) + "\n")
    print(name, len(words), file=sys.stderr)


if __name__ == "__main__":
    if sys.argv[1:] == ["build"]:
        build()
