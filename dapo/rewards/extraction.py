"""The answer in a response and its normal form: the last "Answer:" line, else the last
``\\boxed{}`` (extract_answer), and the canonical string two equal answers share
(normalize_answer). Only string operations, each scan bounded by the work caps below
whatever the response's length: model text is never evaluated."""

from __future__ import annotations

import re

# ---------------------------------------------------------------------------------------
# Work caps. Model text can be anything (1 MB of "{", binary junk): every scan below is
# linear and bounded by one of these, independent of the length of the response.
# ---------------------------------------------------------------------------------------
ANSWER_SCAN_CHARS = 4096  # "Answer:" lines are searched in the last 4096 characters only
BOXED_SCAN_CHARS = 16384  # \boxed{...} is searched in the last 16384 characters only
MAX_BOXED_CHARS = 2048  # a \boxed{...} argument longer than this is treated as unbalanced
MAX_BRACE_DEPTH = 64  # ... and so is one nested deeper than this
MAX_BOXED_CANDIDATES = 16  # how many \boxed occurrences (from the end) are tried
MAX_VERIFY_CHARS = 1024  # longer answers / ground truths skip math-verify (-> not equal)


# ---------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------

# A line that starts with "Answer:" (any case), optionally behind markdown decorations
# ("**Answer:** 42", "## Answer: 42", "> Answer: 42", "- Answer: 42") and optionally as
# "Final Answer:". Anchored at the line start, no nested quantifiers: linear per line.
_ANSWER_LINE_RE = re.compile(r"[ \t>#*_\-]*(?:final[ \t]+)?answer[ \t*_]*[:\uff1a](.*)", re.IGNORECASE)
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BRACE_TOKEN_RE = re.compile(r"\\.|[{}]", re.DOTALL)  # an escape (\{, \}) or a bare brace
_SPACES_RE = re.compile(r"[ \t\r\n]*")
_BARE_ARG_RE = re.compile(r"[^\s${}\\]{1,64}")  # "\boxed 5": TeX's unbraced argument


def answer_line_content(line: str) -> str | None:
    """Content after "Answer:" on `line` (stripped of spaces and markdown stars), else None."""
    m = _ANSWER_LINE_RE.match(line)
    if m is None:
        return None
    return m.group(1).strip().strip("*").strip()


def tail_lines(text: str, n_chars: int) -> list[str]:
    """Lines of the last `n_chars` characters, without a first line cut in the middle."""
    tail = text[-n_chars:]
    lines = tail.splitlines()
    if len(text) > n_chars and text[-n_chars - 1] not in "\r\n" and lines:
        lines = lines[1:]  # its beginning lies before the window: it does not "start" there
    return lines


def _last_answer_line(text: str) -> str | None:
    for line in reversed(tail_lines(text, ANSWER_SCAN_CHARS)):
        content = answer_line_content(line)
        if content:  # an empty "Answer:" (e.g. answer on the next line) does not count
            return content
    return None


def _braced_argument(s: str, i: int) -> tuple[str, int] | None:
    """Argument of a macro whose name ends at s[i]: ``{...}`` (balanced) or one bare token.

    Returns (content, end index) or None if there is none within the caps. Escaped braces
    (``\\{``) do not count. Work is bounded by MAX_BOXED_CHARS whatever the input.
    """
    n = len(s)
    blanks = _SPACES_RE.match(s, i)  # "\\boxed {x}"; a regex, not a Python loop, on long blanks
    i = blanks.end() if blanks else i
    if i >= n:
        return None
    if s[i] != "{":
        m = _BARE_ARG_RE.match(s, i)
        return (m.group(0), m.end()) if m else None
    depth = 0
    for m in _BRACE_TOKEN_RE.finditer(s, i, min(n, i + MAX_BOXED_CHARS + 2)):
        tok = m.group(0)
        if tok == "{":
            depth += 1
            if depth > MAX_BRACE_DEPTH:
                return None
        elif tok == "}":
            depth -= 1
            if depth == 0:
                return s[i + 1 : m.start()], m.end()
    return None  # unbalanced (truncated generation) or over the length cap


def _last_boxed(text: str) -> str | None:
    tail = text[-BOXED_SCAN_CHARS:]
    starts = [m.end() for m in _BOXED_RE.finditer(tail)]
    for pos in reversed(starts[-MAX_BOXED_CANDIDATES:]):
        arg = _braced_argument(tail, pos)
        if arg is not None and arg[0].strip():
            return arg[0].strip()
    return None


def extract_answer(text: str) -> str | None:
    """The model's final answer string ŷ from response y, or None.

    1. the content of the LAST line starting with "Answer:" (the layout the DAPO prompt
       asks for; case-insensitive; markdown like ``**Answer:**`` and "Final Answer:" allowed;
       a line with nothing after the colon is skipped), searched in the last
       ANSWER_SCAN_CHARS (4096) characters;
    2. else the argument of the last ``\\boxed{...}`` / ``\\boxed {...}`` / ``\\fbox{...}``
       with balanced braces (nesting and escaped braces handled), searched in the last
       BOXED_SCAN_CHARS (16384) characters; an unbalanced last box (truncated output)
       falls back to the one before it;
    3. else None.

    Linear in the scanned window and independent of len(text) beyond it.
    """
    if not isinstance(text, str) or not text:
        return None
    answer = _last_answer_line(text)
    if answer is not None:
        return answer
    return _last_boxed(text)


# ---------------------------------------------------------------------------------------
# Normalization (the fast exact-match path)
# ---------------------------------------------------------------------------------------

_TEXT_WRAPPER_RE = re.compile(r"\\(?:text|textrm|textbf|textit|textnormal|mathrm|mathbf|mathit|mbox)\s*\{([^{}]*)\}")
_LEFT_RIGHT_RE = re.compile(r"\\(?:left|right|big|Big|bigg|Bigg)(?![A-Za-z])|\\displaystyle(?![A-Za-z])")
_DEGREE_RE = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ(?![A-Za-z])|\\degree(?![A-Za-z])|°|\\circ(?![A-Za-z])\s*$")
_LATEX_SPACE_RE = re.compile(r"\\[,;:! ]|\\q?quad(?![A-Za-z])|~")
_VAR_PREFIX_RE = re.compile(r"^[A-Za-z]\s*=\s*")
_NUMBER = r"[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)|\\frac\{[^{}]*\}\{[^{}]*\}"
_UNITS_MULTI = (
    r"(?:(?:sq\.?|square|cubic|cu\.?)\s+)?(?:units?|feet|foot|ft|inch(?:es)?|in|yards?|yd|miles?|mi"
    r"|mm|cm|km|(?:milli|centi|kilo)?met(?:er|re)s?)"
    r"|dollars?|cents?|euros?|pounds?|lbs?|ounces?|oz|grams?|kg|kilograms?"
    r"|degrees?|deg|radians?|rad"
    r"|seconds?|secs?|minutes?|mins?|hours?|hrs?|days?|weeks?|months?|years?|yrs?"
    r"|lit(?:er|re)s?|ml|gallons?|gal|mph|km/h|m/s"
)
# Multi-letter units may touch the number ("5cm"); single letters must be separated by
# space ("5 s", "5 g") because "5m" or "5g" could just as well be a product.
_UNIT_SUFFIX_RE = re.compile(
    rf"^(?P<num>{_NUMBER})\s*(?:(?:{_UNITS_MULTI})(?![A-Za-z])|\s(?:m|s|g|l|h)(?![A-Za-z]))"
    r"(?:\s*\^\s*\{?\s*[23]\s*\}?)?$",
    re.IGNORECASE,
)
_THOUSANDS_RE = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
PLAIN_NUMBER_RE = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")
_FRAC_DIGITS_RE = re.compile(r"\\frac(\d)(\d)")
_SQRT_DIGIT_RE = re.compile(r"\\sqrt(\d)")
_WHITESPACE_RE = re.compile(r"\s+")


def _unwrap_boxed(s: str) -> str:
    """``\\boxed{x}`` -> ``x`` when the whole string is one box (repeatedly, at most 3 times)."""
    for _ in range(3):
        m = _BOXED_RE.match(s)
        if m is None:
            break
        arg = _braced_argument(s, m.end())
        if arg is None or s[arg[1] :].strip():
            break
        s = arg[0].strip()
    return s


def _strip_trailing_percent(s: str) -> str:
    """'10 \\%' -> '10'. String ops, not a regex: `\\s*%$` is quadratic on long blank runs."""
    s = s.rstrip()
    if s.endswith("%"):
        s = s[:-1]
        if s.endswith("\\"):
            s = s[:-1]
    return s.rstrip()


def _canonical_decimal(s: str) -> str:
    """'-007.50' -> '-7.5', '5.' -> '5', '-0' -> '0'. String-only: no int() size limits."""
    sign = ""
    if s.startswith("-"):
        sign, s = "-", s[1:]
    whole, _, frac = s.partition(".")
    whole = whole.lstrip("0") or "0"
    frac = frac.rstrip("0")
    out = f"{whole}.{frac}" if frac else whole
    return "0" if out == "0" else sign + out


def normalize_answer(s: str) -> str:
    """Canonical string form of an answer for exact comparison (not a math parser).

    Rules, in order (each cheap, linear, documented by why):
      - unicode minus (U+2212) -> "-"; LaTeX "{,}" -> "," (1{,}000).
      - drop ``\\left``, ``\\right``, ``\\big``-family and ``\\displaystyle`` (sizing only).
      - drop math delimiters: ``\\$`` and ``$`` (currency and inline math look the same
        in answers), ``\\(``, ``\\)``, ``\\[``, ``\\]``.
      - unwrap a whole-string ``\\boxed{...}`` / ``\\fbox{...}``.
      - ``\\dfrac``/``\\tfrac`` -> ``\\frac``, ``\\dbinom``/``\\tbinom`` -> ``\\binom``.
      - unwrap ``\\text{...}``, ``\\mathrm{...}``, ``\\mbox{...}`` etc. (keep the content:
        "\\text{yes}" stays "yes"; units are removed by the unit rule below).
      - drop degree marks (``^\\circ``, ``^{\\circ}``, ``°``, ``\\degree``) and a trailing
        percent sign ("10\\%" -> "10": "what percent" questions take the bare number).
      - LaTeX spacing (``\\,``, ``\\;``, ``\\!``, ``\\ ``, ``\\quad``, ``~``) -> space.
      - strip trailing periods ("42." -> "42").
      - drop a single-letter assignment prefix when it is the only "=" ("x = 5" -> "5").
      - drop ONE unit after a plain number or ``\\frac{a}{b}``: lengths, areas
        ("sq units", "cm^2"), money (dollars, cents), angles, time, mass, volume, speed.
        Count nouns ("12 ways") are left to math-verify.
      - thousands separators: a number whose commas group digits by exactly three with no
        space ("1,000", "12,345.5") loses its commas; anything else with commas ("1,2",
        "1, 234", "1,23") is kept as a list/tuple. "1,234" is read as 1234, not [1, 234].
      - remove all whitespace, then write every remaining comma as ", " (one canonical list
        separator: "(1,2)" and "( 1 , 2 )" both give "(1, 2)");
        ``\\frac12`` -> ``\\frac{1}{2}``, ``\\sqrt2`` -> ``\\sqrt{2}``;
        drop a leading "+".
      - plain decimals are canonicalized ("05" -> "5", "2.50" -> "2.5", "-0" -> "0").
    Case is kept (x and X, \\pi and \\Pi differ).

    The rules are applied until nothing changes (at most 8 passes; usually 2), so the result
    is a fixed point: normalize_answer(normalize_answer(s)) == normalize_answer(s).
    """
    s = str(s)
    for _ in range(8):
        out = _normalize_once(s)
        if out == s:
            break
        s = out
    return s


def _normalize_once(s: str) -> str:
    """One pass of the `normalize_answer` rules."""
    s = s.strip()
    s = s.replace("\u2212", "-").replace("{,}", ",")
    s = _LEFT_RIGHT_RE.sub("", s)  # first: "\\left(" must not leave a "\\(" delimiter behind
    s = s.replace("\\$", "").replace("$", "")
    for delim in ("\\(", "\\)", "\\[", "\\]"):
        s = s.replace(delim, "")
    s = _unwrap_boxed(s.strip())
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\dbinom", "\\binom").replace("\\tbinom", "\\binom")
    for _ in range(3):  # \text{\textbf{cm}}: a few levels, each pass linear
        s, n = _TEXT_WRAPPER_RE.subn(r"\1", s)
        if not n:
            break
    s = _DEGREE_RE.sub("", s)
    s = _strip_trailing_percent(s)
    s = _LATEX_SPACE_RE.sub(" ", s).strip().rstrip(".").strip()
    if s.count("=") == 1:
        s = _VAR_PREFIX_RE.sub("", s)
    m = _UNIT_SUFFIX_RE.match(s)
    if m:
        s = m.group("num")
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    # Lists keep ", " as their separator so that "1, 234" (a pair) never becomes "1,234",
    # which the thousands rule above would read as 1234 on a second pass.
    s = _WHITESPACE_RE.sub("", s).rstrip(".").replace(",", ", ")
    s = _FRAC_DIGITS_RE.sub(r"\\frac{\1}{\2}", s)
    s = _SQRT_DIGIT_RE.sub(r"\\sqrt{\1}", s)
    if s.startswith("+"):
        s = s[1:]
    if PLAIN_NUMBER_RE.fullmatch(s):
        s = _canonical_decimal(s)
    return s
