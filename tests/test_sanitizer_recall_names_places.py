"""The recall rules added after decision 21 (issue 14, decision 32), each with positive cases
taken from presidio-research's synthetic set (tests/bench/data) and negative cases from agent
traffic: the broad name gazetteer, weak lower-case cues, strong cues, list partners, postcodes
after places, places before postcodes, "moved here from".

Everything goes through the product path (`Sanitizer.sanitize_bodies`) with the default
policy, in every placement the benchmark uses."""

from __future__ import annotations

import pytest

from governance.sanitizer import Policy, Sanitizer, names
from tests.bench.sanitize_eval_thirdparty import PLACEMENTS
from tests.test_sanitizer_families import out_text


@pytest.fixture(scope="module")
def sanitizer() -> Sanitizer:
    return Sanitizer(Policy(secret=b"r" * 32))


# (text, values that must not survive) — sentences of the synth set's templates.
POSITIVES = [
    # broad gazetteer: first names ranked 1,001-5,000 in their country, two known names
    ("Wisława Szczepańska's killers sentenced to life in prison", ["Wisława", "Szczepańska"]),
    ("I want to add Irenke Sörös as a beneficiary to my account", ["Irenke", "Sörös"]),
    # list partners: the unfamiliar member beside a person the model found
    ("Is there a better crafted pop song on this list? Torpy and Salinas were precision "
     "engineers.", ["Torpy", "Salinas"]),
    # a later mention of a possessive name
    ("They were singing about the verses from Terence Vassiliev's Cautionary Tales. Is there "
     "a better example of unbridled creativity than early Vassiliev?", ["Vassiliev"]),
    # a postcode after a place the model found, after a country at the end of a block
    ("Looking to support Slashdb in ARENDAL 4844 in its mission to become a market-leading "
     "solution.", ["ARENDAL", "4844"]),
    ("Sven Hedlund\n\n85199 Avda. Rio Nalon 58\n Apt. 461\n Soto del Barco\n\n Spain 61709",
     ["61709"]),
    # a place between a locative preposition and a postcode, and its postcode
    ("Looking to support Allianz in Acquapendente 1021 in its mission.",
     ["Acquapendente", "1021"]),
    # "moved here from" introduces a place
    ("We moved here from Tjæreborg", ["Tjæreborg"]),
]


@pytest.mark.parametrize(("text", "values"), POSITIVES,
                         ids=[f"recall-{i}" for i in range(len(POSITIVES))])
@pytest.mark.parametrize("how", PLACEMENTS)
def test_recall_rule_positive(sanitizer, text, values, how):
    out = out_text(sanitizer, text, how)
    assert not any(v in out for v in values), out


# (text, words that must be kept) — agent traffic the rules must leave alone.
NEGATIVES = [
    # a weak lower-case cue takes no English word that is also a name somewhere
    ("Pushed the fix with sha 3f2a9c1 to main.", ["sha", "main"]),
    # a strong cue takes no past tense
    ("my manager Reviewed the PR yesterday.", ["Reviewed"]),
    # countries are no list of people; a list of cities neither
    ("Please ship to Jordan and Chad by Friday.", ["Jordan", "Chad"]),
    # a year after a place is no postcode; a numbered noun is no place
    ("We opened the office in Lisbon 2019.", ["2019"]),
    ("Build failed in Step 1234 of the pipeline.", ["Step 1234"]),
    ("We came back from lunch at 1300.", ["lunch", "1300"]),
]


def test_comma_before_a_person_is_no_list(sanitizer):
    """A list partner needs an "and" in the list: "Done, Maria Garcia" keeps "Done"."""
    out = out_text(sanitizer, "Done, Maria Garcia is updated.")
    assert out.startswith("Done, <PERSON_") and "Garcia" not in out, out


@pytest.mark.parametrize(("text", "kept"), NEGATIVES,
                         ids=[f"precision-{i}" for i in range(len(NEGATIVES))])
def test_recall_rule_negative(sanitizer, text, kept):
    out = out_text(sanitizer, text)
    assert all(word in out for word in kept), out
    assert "<PERSON_" not in out, out


def test_list_of_people_with_city_names_stays_people(sanitizer):
    """Rogers and Torres are cities too, but a list with a person in it is people."""
    out = out_text(sanitizer, "Galorath Incorporated is the brainchild of our 3 founders: "
                              "Morrison, Rogers and Torres.")
    assert not any(v in out for v in ("Morrison", "Rogers", "Torres")), out


def test_broad_names_only_for_capitalised_words():
    """The broad lists confirm "Irenke" but never lower-case text, and hold no common English
    word ("Radio", "Glad" are names somewhere)."""
    assert names.is_first("Irenke") and not names.is_first("irenke")
    assert not names.is_name("Radio") and not names.is_name("Glad") and not names.is_name("Xqzzyv")
    first, last = names.broad_gazetteer()
    assert len(first) > 100_000 and len(last) > 100_000
    assert "main" in names.english_names() and "wisława" not in names.english_names()
