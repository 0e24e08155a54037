"""Build the secrets corpus from gitleaks' own positive test cases (MIT, see data/LICENSE-gitleaks).

Every rule of gitleaks (cmd/generate/config/rules/*.go) ends with `utils.Validate(r, tps, fps)`:
`tps` are strings its authors assert the rule must find. This module reads those Go sources,
evaluates the small expression language they are written in (string literals, `+`,
`[]string{...}`, `append(...)`, `utils.GenerateSampleSecret(s)`, `secrets.NewSecret(regex)`,
`utils.AlphaNumeric("N")`, ...) and writes one JSON line per positive case:

    {"rule": "openai-api-key", "text": "<the whole test line>", "secret": "<the secret in it>"}

`secret` is the argument given to GenerateSampleSecret(s) when the case was built that way, else
the part of the text gitleaks' generated rule (config/gitleaks.toml) captures (its secretGroup,
else group 1, else the whole match); a literal case whose secret cannot be located that way is
left out. `secrets.NewSecret(regex)` draws from the regex with a seeded generator, so the corpus
is the same on every build. GenerateSampleSecrets expands one secret into ~30 file formats; we
keep 3 of them per call (seeded choice) so one vendor does not dominate the corpus.

    python -m tests.bench.gitleaks_corpus GITLEAKS_CHECKOUT > tests/bench/data/gitleaks_tps.jsonl
"""

from __future__ import annotations

import json
import random
import re
import string
import sys
import tomllib
from pathlib import Path
from re import _constants as C  # the parser re itself uses
from re import _parser as sre_parse

SAMPLE_TEMPLATES = [  # utils.GenerateSampleSecrets, verbatim from gitleaks' generate.go
    '{i}Token="{s}"', '{i}Token = "{s}"', "{i}Token={s}", "{i}Token = {s}",
    '{\n    "{i}_token": "{s}"\n}', '{"config.ini": "{I}_TOKEN={s}\\nBACKUP_ENABLED=true"}',
    "<{i}Token>\n    {s}\n</{i}Token>", "{i}_token: {s}", "{i}_token: '{s}'",
    '{i}_token: "{s}"', 'string {i}Token = "{s}";', 'var {i}Token string = "{s}"',
    '{i}Token := "{s}"', "{i}Token := `{s}`", 'String {i}Token = "{s}";',
    'var {i}Token = "{s}"', '${i}Token .= "{s}"', "{i}Token = '{s}'", '{i}Token = "{s}"',
    'System.setProperty("{I}_TOKEN", "{s}")', '  "{i}Token" => "{s}"', '{i}_TOKEN = "{s}"',
    '{i}_TOKEN := "{s}"', '{i}_TOKEN ::= "{s}"', '{i}_TOKEN :::= "{s}"', '{i}_TOKEN ?= "{s}"',
]
PER_CALL = 3
UTIL_CLASSES = {
    "Numeric": "[0-9]{%s}", "Hex": "[a-f0-9]{%s}", "AlphaNumeric": "[a-z0-9]{%s}",
    "AlphaNumericExtendedShort": "[a-z0-9_-]{%s}", "AlphaNumericExtended": "[a-z0-9=_\\-]{%s}",
    "AlphaNumericExtendedLong": "[a-z0-9\\/=_\\+\\-]{%s}",
}
HEX_UUID = "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


# --- a generator of strings matching a regex (what gitleaks' reggen does) ------------------------

def _gen(parsed, rng: random.Random, out: list[str]) -> None:
    for op, av in parsed:
        if op is C.LITERAL:
            out.append(chr(av))
        elif op is C.ANY:
            out.append(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789"))
        elif op is C.IN:
            out.append(_in(av, rng))
        elif op in (C.MAX_REPEAT, C.MIN_REPEAT):
            lo, hi, sub = av
            hi = lo + 10 if hi is C.MAXREPEAT else hi
            for _ in range(rng.randint(lo, hi)):
                _gen(sub, rng, out)
        elif op is C.SUBPATTERN:
            _gen(av[-1], rng, out)
        elif op is C.BRANCH:
            _gen(rng.choice(av[1]), rng, out)
        elif op in (C.AT, C.ASSERT, C.ASSERT_NOT):
            continue
        elif op is C.CATEGORY:
            out.append(_in([(op, av)], rng))
        else:
            raise ValueError(f"unsupported regex op {op}")


def _in(items, rng: random.Random) -> str:
    chars: list[str] = []
    negate = False
    for op, av in items:
        if op is C.NEGATE:
            negate = True
        elif op is C.LITERAL:
            chars.append(chr(av))
        elif op is C.RANGE:
            chars.extend(chr(c) for c in range(av[0], av[1] + 1))
        elif op is C.CATEGORY:
            chars.extend({C.CATEGORY_DIGIT: "0123456789",
                          C.CATEGORY_WORD: string.ascii_letters + string.digits + "_",
                          C.CATEGORY_SPACE: " "}.get(av, "x"))
    if negate:
        pool = [c for c in "abcdefghijklmnopqrstuvwxyz0123456789" if c not in chars]
        return rng.choice(pool)
    return rng.choice(chars)


def new_secret(regex: str, rng: random.Random) -> str:
    out: list[str] = []
    _gen(sre_parse.parse(regex), rng, out)
    return "".join(out)


# --- the Go expression evaluator ------------------------------------------------------------------

_TOKEN = re.compile(r'''
    (?P<ws>\s+|//[^\n]*|/\*.*?\*/)
  | (?P<str>"(?:[^"\\\n]|\\.)*")
  | (?P<raw>`[^`]*`)
  | (?P<ident>[A-Za-z_][\w.]*)
  | (?P<ellipsis>\.\.\.)
  | (?P<punct>[()\[\]{},+])
  | (?P<other>.)
''', re.S | re.X)


def _go_string(lit: str) -> str:
    body = lit[1:-1]
    return json.loads('"' + body.replace("\\'", "'").replace("\\x60", "`") + '"') \
        if "\\x" not in body else bytes(body, "utf-8").decode("unicode_escape")


class _Eval:
    """Recursive descent over the tokens of one tps expression; values are str or list[str]."""

    def __init__(self, tokens: list[tuple[str, str]], rng: random.Random, rule: str,
                 consts: dict[str, str | list[str]]):
        self.t, self.i, self.rng, self.rule, self.consts = tokens, 0, rng, rule, consts
        self.secrets: dict[str, str] = {}  # text -> secret, for GenerateSampleSecret(s) cases

    def peek(self) -> tuple[str, str]:
        return self.t[self.i] if self.i < len(self.t) else ("eof", "")

    def take(self, value: str | None = None) -> tuple[str, str]:
        tok = self.peek()
        if value is not None and tok[1] != value:
            raise ValueError(f"expected {value!r}, got {tok[1]!r}")
        self.i += 1
        return tok

    def expr(self):
        value = self.primary()
        while self.peek()[1] == "+":
            self.take("+")
            right = self.primary()
            value = value + right
        return value

    def args(self) -> list:
        self.take("(")
        out = []
        while self.peek()[1] != ")":
            out.append(self.expr())
            if self.peek()[1] == "...":
                self.take()
            if self.peek()[1] == ",":
                self.take(",")
        self.take(")")
        return out

    def primary(self):
        kind, value = self.take()
        if kind == "str":
            return _go_string(value)
        if kind == "raw":
            return value[1:-1]
        if value == "[":
            self.take("]")
            self.take()  # string
            self.take("{")
            items = []
            while self.peek()[1] != "}":
                items.append(self.expr())
                if self.peek()[1] == ",":
                    self.take(",")
            self.take("}")
            return [x for x in items]
        if kind == "ident":
            if self.peek()[1] != "(":
                if value in self.consts:
                    return self.consts[value]
                raise ValueError(f"unknown identifier {value}")
            args = self.args()
            name = value.rsplit(".", 1)[-1]
            if name == "append":
                out = list(args[0])
                for a in args[1:]:
                    out.extend(a if isinstance(a, list) else [a])
                return out
            if name == "NewSecret":
                return new_secret(args[0], self.rng)
            if name in UTIL_CLASSES:
                return UTIL_CLASSES[name] % args[0]
            if name == "Hex8_4_4_4_12":
                return HEX_UUID
            if name == "GenerateSampleSecret":
                text = f'{args[0]}_api_token = "{args[1]}"'
                self.secrets[text] = args[1]
                return text
            if name == "GenerateSampleSecrets":
                ident, secret = args
                chosen = self.rng.sample(SAMPLE_TEMPLATES, PER_CALL)
                texts = [t.replace("{i}", ident).replace("{I}", ident.upper())
                         .replace("{s}", secret) for t in chosen]
                for t in texts:
                    self.secrets[t] = secret
                return texts
            if name in ("Sprintf",):
                fmt, *rest = args
                return fmt % tuple(rest)
            if name == "Repeat":
                return args[0] * int(args[1])
            raise ValueError(f"unsupported call {value}")
        raise ValueError(f"unexpected token {value!r}")


def _tokens(src: str) -> list[tuple[str, str]]:
    out = []
    for m in _TOKEN.finditer(src):
        kind = m.lastgroup
        if kind == "ws":
            continue
        out.append(("punct" if kind in ("punct", "ellipsis", "other") else kind, m.group(0)))
    return out


_FUNC = re.compile(r"^func (\w+)\(\) \*config\.Rule \{", re.M)


def _tps_statements(body: str) -> list[str]:
    """The right-hand sides of `tps := ...` / `tps = ...` statements, in order."""
    out = []
    for m in re.finditer(r"^\s*tps\s*:?=\s*", body, re.M):
        start = m.end()
        depth, i = 0, start
        in_str: str | None = None
        while i < len(body):
            ch = body[i]
            if in_str:
                if ch == "\\" and in_str == '"':
                    i += 2
                    continue
                if ch == in_str:
                    in_str = None
            elif ch in '"`':
                in_str = ch
            elif body.startswith("//", i):
                i = body.find("\n", i)
                continue
            elif ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth -= 1
            elif ch == "\n" and depth == 0:
                break
            i += 1
        out.append(body[start:i])
    return out


def _toml_rules(root: Path) -> dict[str, tuple[re.Pattern[str] | None, int]]:
    import warnings

    warnings.simplefilter("ignore", FutureWarning)  # Go regexes with "[[" classes
    data = tomllib.loads((root / "config" / "gitleaks.toml").read_text())
    rules = {}
    for rule in data.get("rules", []):
        try:
            rx = re.compile(rule.get("regex", ""))
        except re.error:
            rx = None
        rules[rule["id"]] = (rx, int(rule.get("secretGroup", 0)))
    return rules


def _locate(text: str, rule: tuple[re.Pattern[str] | None, int]) -> str | None:
    rx, group = rule
    if rx is None:
        return None
    m = rx.search(text)
    if m is None:
        return None
    if group and group <= (rx.groups or 0):
        return m.group(group)
    return m.group(1) if rx.groups else m.group(0)


def build(root: Path, seed: int = 14) -> tuple[list[dict], dict[str, int]]:
    toml = _toml_rules(root)
    cases: list[dict] = []
    skipped: dict[str, int] = {}
    for path in sorted((root / "cmd/generate/config/rules").glob("*.go")):
        src = path.read_text()
        consts = {m.group(1): _go_string(m.group(2)) for m in re.finditer(
            r'^\s*(\w+)\s*:?=\s*("(?:[^"\\\n]|\\.)*")\s*$', src, re.M)}
        funcs = list(_FUNC.finditer(src))
        for k, fm in enumerate(funcs):
            body = src[fm.start(): funcs[k + 1].start() if k + 1 < len(funcs) else len(src)]
            rid = re.search(r'RuleID:\s*"([^"]+)"', body)
            if rid is None:
                continue
            rule_id = rid.group(1)
            rng = random.Random(f"{seed}:{rule_id}")
            texts: list[str] = []
            secrets: dict[str, str] = {}
            for stmt in _tps_statements(body):
                ev = _Eval(_tokens(stmt), rng, rule_id, {**consts, "tps": texts})
                try:
                    value = ev.expr()
                except (ValueError, IndexError, KeyError, TypeError, re.error) as exc:
                    skipped[f"{rule_id}: {exc}"[:120]] = 1
                    continue
                texts = value if isinstance(value, list) else texts + [value]
                secrets.update(ev.secrets)
            for text in dict.fromkeys(texts):
                secret = secrets.get(text) or _locate(text, toml.get(rule_id, (None, 0)))
                if not secret or len(secret.strip()) < 6 or secret not in text:
                    skipped[rule_id] = skipped.get(rule_id, 0) + 1
                    continue
                cases.append({"rule": rule_id, "text": text, "secret": secret.strip()})
    return cases, skipped


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = Path(argv[0])
    cases, skipped = build(root)
    for c in cases:
        sys.stdout.write(json.dumps(c, ensure_ascii=False) + "\n")
    print(f"{len(cases)} cases from {len({c['rule'] for c in cases})} rules; "
          f"{sum(skipped.values())} left out", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
